"""When onepass's ops run in a Hugging Face model: the parts recognised, patched and undone."""

from onepass.models import gpt2  # noqa: F401 - registers its family
