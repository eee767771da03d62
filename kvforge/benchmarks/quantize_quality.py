"""4-bit quantization quality of the default model on the held-out texts: RTN, GPTQ and AWQ at each group
size against float32 and W8A16, with each quantizer's time and peak memory.

    python -m kvforge.benchmarks.quantize_quality --checkpoints DIR [--group-sizes 64,32]
        [--num-sequences 128 --sequence-length 512]

Each checkpoint is written by `kvforge quantize` in a process of its own (so its peak memory is its
own), unless DIR already has it; then every row is scored with `kvforge eval perplexity`'s windows on
every shipped held-out text. Prints a Markdown table (perplexity per text, the mean, the ratio to RTN
of the same group size) and whether each target holds: GPTQ and AWQ below RTN on every text, W8A16
within 0.5% of float32 on every text.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from kvforge.eval.perplexity import default_evaluation_texts, perplexity
from kvforge.llm import LLM

_QUANTIZED = re.compile(r"in ([\d.]+) s, peak memory (\d+) MiB")


def write_checkpoint(out: Path, method: str, group_size: int, args: argparse.Namespace) -> str:
    """`kvforge quantize` into out unless it is there; its 'N s, M MiB' note."""
    note_file = out / "quantize-note.txt"
    if not (out / "config.json").is_file():
        command = [sys.executable, "-m", "kvforge.cli", "quantize", "--method", method, "--bits", "4",
                   "--group-size", str(group_size), "--out", str(out), "--num-sequences", str(args.num_sequences),
                   "--sequence-length", str(args.sequence_length)]  # fmt: skip
        command += ["--act-order"] if method == "gptq" else []
        printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        found = _QUANTIZED.search(printed)
        note_file.write_text(f"{float(found[1]):.0f} s, {found[2]} MiB" if found else "")
    return note_file.read_text() if note_file.is_file() else ""


def rows(args: argparse.Namespace) -> list[tuple[str, dict, str]]:
    """(row name, LLM keyword arguments, quantize note) of every row, checkpoints written first."""
    root = Path(args.checkpoints)
    table = [("float32", {}, ""), ("W8A16 (RTN, asym g64)", {"quantization": "w8a16"}, "")]
    for group_size in args.group_sizes:
        for method, label in (("rtn", "RTN"), ("gptq", "GPTQ act-order"), ("awq", "AWQ")):
            out = root / f"{method}-g{group_size}"
            note = write_checkpoint(out, method, group_size, args)
            table.append((f"W4 {label} g{group_size}", {"model": str(out)}, note))
    return table


def evaluate(texts: dict[str, str], kwargs: dict, max_length: int, stride: int) -> dict[str, float]:
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="256MiB", **kwargs)
    tokenizer = llm.get_tokenizer()
    result = {name: perplexity(llm.engine, tokenizer.encode(text), max_length, stride).perplexity
              for name, text in texts.items()}  # fmt: skip
    llm.shutdown()
    return result


def report(results: dict[str, dict[str, float]], notes: dict[str, str], texts: list[str]) -> list[str]:
    """The Markdown table and the target checks."""
    lines = [f"| row | {' | '.join(texts)} | mean | vs RTN (mean) | quantize time, peak memory |",
             "|---" * (len(texts) + 4) + "|"]  # fmt: skip
    checks = []
    for name, by_text in results.items():
        mean = sum(by_text.values()) / len(by_text)
        rtn_name = re.sub(r"(GPTQ act-order|AWQ)", "RTN", name)
        ratio = ""
        if rtn_name != name and rtn_name in results:
            rtn = results[rtn_name]
            ratio = f"{mean / (sum(rtn.values()) / len(rtn)):.3f}x"
            worse = [t for t in texts if by_text[t] >= rtn[t]]
            checks.append(f"{name} below {rtn_name} on every text: {'yes' if not worse else 'NO: ' + ', '.join(worse)}")
        cells = " | ".join(f"{by_text[t]:.3f}" for t in texts)
        lines.append(f"| {name} | {cells} | {mean:.3f} | {ratio} | {notes.get(name, '')} |")
    float_ppl, w8 = results["float32"], results["W8A16 (RTN, asym g64)"]
    drift = max(w8[t] / float_ppl[t] - 1 for t in texts)
    checks.append(f"W8A16 within 0.5% of float32 on every text: {'yes' if drift <= 0.005 else 'NO'} "
                  f"(largest: {100 * drift:+.2f}%)")  # fmt: skip
    return [*lines, "", *checks]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", required=True, help="folder for (or with) the quantized checkpoints")
    parser.add_argument("--group-sizes", default="64,32", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--num-sequences", type=int, default=128)
    parser.add_argument("--sequence-length", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=512, help="perplexity window")
    parser.add_argument("--stride", type=int, default=256)
    args = parser.parse_args(argv)
    texts = default_evaluation_texts()
    table = rows(args)
    results, notes = {}, {}
    for name, kwargs, note in table:
        results[name], notes[name] = evaluate(texts, kwargs, args.max_length, args.stride), note
        print(f"{name}: " + ", ".join(f"{t} {p:.3f}" for t, p in results[name].items()), flush=True)
    print("\n".join(["", *report(results, notes, list(texts))]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
