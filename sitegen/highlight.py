"""Kernel source as a run page shows it: escaped text tagged with its language, highlighted by the
reader's browser (static/code.js, highlight.js vendored under static/highlight/).

Highlighting on the server (Pygments) cost ~20 ms of lexing per solution — ~100 s of a cold 10,000-run
build, plus a 0.6 GB cache to avoid paying it twice — and its markup was 89% of each run page. Tagged
plain text costs nothing to build, is a fifth of the bytes, and still reads without JavaScript."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LANGUAGES", "Code", "code", "language_for", "page_gives_back"]

#: File suffix -> the highlight.js language static/code.js registers. Solutions are Python; sidecars are
#: CUDA or C++ sources and headers, which the cpp grammar reads (C included). Any other file is shown as
#: plain text ("plaintext" is not highlighted).
LANGUAGES: dict[str, str] = {
    ".py": "python",
    **dict.fromkeys((".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh", ".inl"), "cpp"),
}


def language_for(filename: str) -> str:
    """The language a file is highlighted as, from its name: 'python', 'cpp' or 'plaintext'."""
    dot = filename.rfind(".")
    return LANGUAGES.get(filename[dot:].lower(), "plaintext") if dot >= 0 else "plaintext"


@dataclass(frozen=True)
class Code:
    """One source file for templates/_code.html: its text (escaped by the template), its language and its
    line numbers (one per line, a gutter that stays beside the code without JavaScript)."""

    text: str
    language: str

    @property
    def line_numbers(self) -> str:
        lines = self.text.count("\n") + (0 if self.text.endswith("\n") or not self.text else 1)
        return "\n".join(map(str, range(1, max(lines, 1) + 1)))


def code(text: str, filename: str = "solution.py") -> Code:
    """`text` as the run page shows it, tagged with the language `filename` says."""
    return Code(text, language_for(filename))


def page_gives_back(text: str) -> bool:
    """Whether the source as the page carries it reads back as the same text, so the browser can offer
    it as the raw file (static/code.js makes the download from the page): an HTML parser turns NUL into
    U+FFFD, and CR into LF (sources are read as text, so they hold none). A source with either is
    published as its own file instead; the others are not, which halves the run folders' files and bytes."""
    return "\r" not in text and "\0" not in text
