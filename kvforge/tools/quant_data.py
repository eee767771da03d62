"""Rebuild the calibration set and the held-out evaluation texts shipped in kvforge/data/.

    python -m kvforge.tools.quant_data [--seed 0] [--skip-generated]

Every source is public domain or permissively licensed and is read from the Python standard library or
from a package that kvforge installs, so the build runs offline; kvforge/data/SOURCES.md lists each with
its licence. From each source the build takes whole paragraphs (or source lines) starting at seeded
random places until it has the source's share of characters. The dialogue part is written by the default
model itself from varied seed prompts (data-free calibration, as in the literature), since none of the
installed texts is conversation.

The evaluation texts are other documents altogether (a project-written essay, a licence, a standard
library module that the calibration code does not include), so perplexity on them measures text the
quantizer never saw.
"""

from __future__ import annotations

import argparse
import importlib.util
import pydoc_data.topics
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
_STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed; it holds {relative}")
    return Path(next(iter(spec.submodule_search_locations))) / relative


def _dist_file(distribution: str, relative: str) -> Path:
    from importlib.metadata import distribution as find

    return Path(str(find(distribution).locate_file(relative)))


@dataclass(frozen=True, slots=True)
class Source:
    kind: str  # the calibration file it goes to
    name: str
    licence: str
    num_chars: int  # characters taken
    path: Path | None = None  # None: the Python documentation's topics

    def text(self) -> str:
        if self.path is None:
            return "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
        return self.path.read_text(encoding="utf-8")


def calibration_sources() -> list[Source]:
    stdlib = ["textwrap.py", "heapq.py", "shlex.py", "csv.py", "argparse.py", "json/decoder.py",
              "json/encoder.py", "string.py", "difflib.py", "calendar.py"]  # fmt: skip
    return [
        Source("prose", "Isaac Newton, Opticks (1730), Project Gutenberg transcription", "public domain",
               90_000, _package_file("tvm_ffi", "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt")),
        Source("technical", "Python documentation, language reference topics (pydoc_data)", "PSF-2.0",
               70_000),
        *[Source("code", f"Python standard library, {name}", "PSF-2.0", 6_000, _STDLIB / name) for name in stdlib],
        Source("code", "PyTorch c10/util/SmallVector.h (C++)", "BSD-3-Clause", 12_000,
               _package_file("torch", "include/c10/util/SmallVector.h")),
        Source("code", "matplotlib web backend mpl.js (JavaScript)", "matplotlib licence (PSF-based)", 12_000,
               _package_file("matplotlib", "backends/web_backend/js/mpl.js")),
        Source("markup", "pydantic package description (Markdown, release notes)", "MIT", 30_000,
               _dist_file("pydantic", "pydantic-" + _version("pydantic") + ".dist-info/METADATA")),
        Source("markup", "rich package description (Markdown, tables and lists)", "MIT", 15_000,
               _dist_file("rich", "rich-" + _version("rich") + ".dist-info/METADATA")),
        Source("markup", "JSON Schema 2020-12 meta-schemas (JSON)", "MIT", 10_000,
               _package_file("jsonschema_specifications", "schemas/draft202012/metaschema.json")),
    ]  # fmt: skip


def evaluation_sources() -> list[Source]:
    return [
        Source("licence", "Apache License 2.0, as shipped by requests", "Apache-2.0 (the licence text itself)",
               10_000, _dist_file("requests", "requests-" + _version("requests") + ".dist-info/licenses/LICENSE")),
        Source("code", "Python standard library, fractions.py", "PSF-2.0", 9_000, _STDLIB / "fractions.py"),
    ]  # fmt: skip


def _version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


def sample_paragraphs(text: str, num_chars: int, rng: random.Random, piece_chars: int = 3_000) -> str:
    """Whole lines from seeded random starts, piece by piece, until num_chars (the whole text if shorter)."""
    if len(text) <= num_chars:
        return text
    lines = text.splitlines(keepends=True)
    starts = list(range(len(lines)))
    rng.shuffle(starts)
    taken: set[int] = set()
    pieces: list[str] = []
    total = 0
    for start in starts:
        if total >= num_chars:
            break
        piece, index = [], start
        while index < len(lines) and index not in taken and sum(map(len, piece)) < piece_chars:
            piece.append(lines[index])
            taken.add(index)
            index += 1
        if piece:
            pieces.append("".join(piece))
            total += sum(map(len, piece))
    return "\n".join(pieces)


DIALOGUE_SEEDS = [
    "Write a conversation between a customer and a baker about a birthday cake.",
    "Write a dialogue between two hikers who are lost in the mountains.",
    "Write a phone call between a patient and a doctor's receptionist booking an appointment.",
    "Write a chat between a teacher and a student who forgot their homework.",
    "Write a dialogue where a tourist asks for directions to the train station.",
    "Write a job interview for a position at a bookshop.",
    "Write an argument between two siblings about who gets the last slice of pizza.",
    "Write a conversation between a mechanic and a driver whose car makes a strange noise.",
    "Write a dialogue between a detective and a witness of a burglary.",
    "Write a conversation between two friends planning a weekend trip to the sea.",
    "Write a dialogue between a librarian and a child looking for a book about dinosaurs.",
    "Write a support chat where a user cannot log in to their email account.",
    "Write a conversation between a farmer and a journalist about a dry summer.",
    "Write a dialogue between a chess coach and a beginner after a lost game.",
    "Write an interview with a retired astronaut about her first flight.",
    "Write a conversation at a restaurant between a waiter and a guest with an allergy.",
]


def generated_dialogue(seed: int, max_tokens: int = 256) -> str:
    """Conversations written by the default model from the seed prompts (sampled, seeded)."""
    from kvforge.llm import LLM
    from kvforge.sampling_params import SamplingParams

    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="256MiB")
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=seed + i)
              for i in range(len(DIALOGUE_SEEDS))]  # fmt: skip
    outputs = llm.chat([[{"role": "user", "content": p}] for p in DIALOGUE_SEEDS], params)
    llm.shutdown()
    return "\n\n".join(output.outputs[0].text.strip() for output in outputs)


def build(seed: int, with_generated: bool) -> dict[str, str]:
    """File name under kvforge/data -> text."""
    rng = random.Random(seed)
    files: dict[str, list[str]] = {}
    for source in calibration_sources():
        files.setdefault(f"calibration/{source.kind}.txt", []).append(
            sample_paragraphs(source.text(), source.num_chars, rng)
        )
    if with_generated:
        files["calibration/dialogue.txt"] = [generated_dialogue(seed)]
    for source in evaluation_sources():
        files[f"evaluation/{source.kind}.txt"] = [source.text()[: source.num_chars]]
    return {name: "\n\n".join(parts) for name, parts in files.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-generated", action="store_true", help="keep the shipped dialogue.txt")
    args = parser.parse_args(argv)
    for name, text in build(args.seed, not args.skip_generated).items():
        (DATA / name).parent.mkdir(exist_ok=True)
        (DATA / name).write_text(text, encoding="utf-8")
        print(f"{name}: {len(text)} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
