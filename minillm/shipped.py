"""The models that ship inside the package, by name; nothing here imports PyTorch (the CLI's help reads it)."""

from __future__ import annotations

from pathlib import Path

SHIPPED_MODELS_DIR = Path(__file__).parent / "models"

DEFAULT_MODEL = "shakespeare-11m"  # the target: what chapters generate with
DEFAULT_DRAFT = "shakespeare-1m"  # its draft, for speculative decoding


def shipped_models() -> list[str]:
    """Names of the models that ship inside the package."""
    if not SHIPPED_MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_MODELS_DIR.iterdir() if (p / "config.json").is_file())
