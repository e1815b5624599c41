"""Model families onepass knows, and built-in model configurations (``onepass.models.configs``)."""
