"""Config-only presets: ``config.json`` files of models users may plan for without having them.

``radixserve memory --model llama-2-70b`` reads ``llama-2-70b.json`` from this folder. The
contents are the published Hugging Face configs of those models.
"""

from __future__ import annotations

from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parent


def list_presets() -> list[str]:
    """Names of the shipped presets (file stems), sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset_path(name: str) -> Path | None:
    """The preset's ``config.json`` path for ``name`` (case-insensitive), or None."""
    path = PRESETS_DIR / f"{name.lower()}.json"
    return path if path.is_file() else None
