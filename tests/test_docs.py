"""The README says what the code does: its table of settings is the one `service.config.reference()` writes."""

from __future__ import annotations

from pathlib import Path

from service.config import Settings, reference

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- settings: the output of service.config.reference() -->", "<!-- /settings -->"


def _readme_table() -> str:
    text = README.read_text()
    assert BEGIN in text and END in text, f"README.md lacks the settings table between {BEGIN} and {END}"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def test_readme_lists_every_setting_with_its_default_and_meaning() -> None:
    """Regenerate with: python -c "from service.config import reference; print(reference())" """
    assert _readme_table() == reference()


def test_reference_names_every_setting_once() -> None:
    table = reference()
    for name in Settings.model_fields:
        assert table.count(f"`ANYTIME_{name.upper()}`") == 1
