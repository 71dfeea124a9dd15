"""Files shipped inside the package: the embedded stories260K demo model."""

from pathlib import Path


def demo_model_path() -> str:
    """Directory of the stories260K demo model in Hugging Face Llama format."""
    return str(Path(__file__).resolve().parent / "stories260K")
