"""Format version 3 on real vLLM: a checkpoint of generations behind one pointer.

One rank (Llama): a save with ``format_version=3`` loads token-exact against the engine it was saved from (vLLM's
default loader, observed), and a tokenizer of another save at the top is refused by name.

Two ranks (Qwen3, TP=2), a loader racing a writer: a loader's engine starts on save A and both its ranks pause once they
agreed on a generation (``TENSORIZER_MANIFEST_PAUSE_AT=after-agreement``); a re-save of another model B commits
meanwhile, then a second re-save (C, B's weights committed again through the writers' API) and a ``gc`` run;
released, the loader must answer as A (both ranks report A's generation), and a fresh load then answers as B's
weights, from C. Version 2 let such a load answer as neither.

On S3 (moto, ``TM_TEST_S3_ENDPOINT``/``_KEY_ID``/``_SECRET``), the same two TP=2 saves as local checkpoints of
one generation each, uploaded by racing writers: A's upload (a process of its own) paused with its files up, before
its pointer PUT (``before-commit``), B's upload to completion, A released: A is refused (``ConcurrentWriteError``).
Then A again over B with rank 1's manifest upload failing: refused, nothing committed. A TP=2 engine then loads
from the bucket and answers as B, every rank on B's generation.

Usage: python tests/scenarios/generations.py WORKDIR. Prints ``GENERATIONS_RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/, for helpers

TP2 = {"distributed_executor_backend": "mp", "tensor_parallel_size": 2}
B_GENERATION_CONFIG = {"temperature": 0.25, "top_k": 7}
B_MODEL_MAX_LENGTH = 77

#: The raced loader, a process of its own: its engine's workers inherit the pause from its environment.
_RACED_LOADER = """
import json, sys
from tensorizer_manifest.cli.demo import engine_options, greedy_tokens
from tensorizer_manifest.save.from_source import shutdown
from vllm import LLM
llm = LLM(model=sys.argv[1], load_format="tensorizer_manifest", **engine_options(
    worker_extension_cls="tensorizer_manifest.vllm_integration.ManifestWorkerExtension",
    distributed_executor_backend="mp", tensor_parallel_size=2))
try:
    reports = llm.collective_rpc("tensorizer_manifest_report")
    tokens, _ = greedy_tokens(llm)
    defaults = llm.get_default_sampling_params()  # vLLM reads generation_config.json now, after the load
    read = {"temperature": defaults.temperature, "top_k": defaults.top_k,
            "model_max_length": llm.get_tokenizer().model_max_length, "model": llm.llm_engine.model_config.model}
finally:
    shutdown(llm)
print("RACED " + json.dumps({"tokens": tokens, "generations": [r["generation"] for r in reports], "read": read}),
      flush=True)
"""


#: A writer of the S3 race, a process of its own (the pause is in its environment only).
_RACING_UPLOAD = """
import sys
from tensorizer_manifest import upload_checkpoint
from tensorizer_manifest.errors import ConcurrentWriteError
from tensorizer_manifest.storage.remote import RemoteOptions
try:
    upload_checkpoint(sys.argv[1], sys.argv[2], RemoteOptions(*sys.argv[3].split(",")))
    print("UPLOAD committed", flush=True)
except ConcurrentWriteError as exc:
    print("UPLOAD refused ConcurrentWriteError: " + str(exc), flush=True)
"""


def _capture_save(model_dir: Path, out: str, **engine) -> tuple[list, dict]:
    """Tokens of an engine vLLM's default loader loaded (observed by the capture loader), then its save as a
    generation of ``out``."""
    from vllm import LLM

    from tensorizer_manifest import CAPTURE_LOAD_FORMAT, WORKER_EXTENSION
    from tensorizer_manifest.cli.demo import engine_options, greedy_tokens
    from tensorizer_manifest.save.from_source import shutdown

    llm = LLM(
        model=str(model_dir),
        load_format=CAPTURE_LOAD_FORMAT,
        **engine_options(worker_extension_cls=WORKER_EXTENSION, **engine),
    )
    try:
        tokens, _ = greedy_tokens(llm)
        saved = llm.collective_rpc("save_tensorizer_manifest", args=(out,), kwargs={"format_version": 3})
    finally:
        shutdown(llm)
    return tokens, saved[0]


def one_rank(workdir: str) -> dict:
    from helpers.errors import error_chain

    from tensorizer_manifest import LOAD_FORMAT
    from tensorizer_manifest.cli.demo import generate_tokens
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model
    from tensorizer_manifest.storage.generations import LocalCheckpoint

    model_dir = build_tiny_model(os.path.join(workdir, "tiny-llama"), "llama")
    out = os.path.join(workdir, "ckpt-llama-v3")
    reference, saved = _capture_save(model_dir, out)
    report: dict = {}
    tokens, _, _ = generate_tokens(out, "tensorizer_manifest", report=report)
    generation = LocalCheckpoint(out).current()
    result = {
        "reference": reference,
        "tokens": tokens,
        "saved_generation": saved["generation"],
        "loaded_generation": report.get("generation"),
        "current": generation.id,
        "checkpoint": out,
        "model_files": [m.name for m in generation.model_files],
        "top_level": sorted(os.listdir(out)),
    }
    pinned: dict = {}  # vLLM's model is the generation's own folder: everything it reads is that generation's
    result["pinned_tokens"], _, _ = generate_tokens(Path(out, "generations", generation.id), LOAD_FORMAT, report=pinned)
    result["pinned_generation"] = pinned.get("generation")
    tokenizer = Path(out, "tokenizer_config.json")
    tokenizer.write_text(tokenizer.read_text().replace("}", ', "model_max_length": 7}', 1))  # another save's
    result["other_tokenizer_at_top"] = _tokens_and_what_vllm_read(out)  # vLLM reads the generation's own
    elsewhere = Path(workdir, "model-files-of-another-save")  # vLLM's model named apart from the checkpoint
    elsewhere.mkdir(exist_ok=True)
    for model_file in generation.model_files:
        (elsewhere / model_file.name).write_bytes(Path(out, model_file.name).read_bytes())
    try:
        generate_tokens(elsewhere, "tensorizer_manifest", loader_config={"checkpoint_dir": out})
        result["other_tokenizer"] = None
    except Exception as exc:  # noqa: BLE001
        result["other_tokenizer"] = error_chain(exc)
    return result


def _tokens_and_what_vllm_read(model: str) -> dict:
    from vllm import LLM

    from tensorizer_manifest.cli.demo import engine_options, greedy_tokens
    from tensorizer_manifest.save.from_source import shutdown

    llm = LLM(model=model, load_format="tensorizer_manifest", **engine_options())
    try:
        tokens, _ = greedy_tokens(llm)
        return {
            "tokens": tokens,
            "model_max_length": llm.get_tokenizer().model_max_length,
            "model": llm.llm_engine.model_config.model,
            "served_model_name": llm.llm_engine.model_config.served_model_name,
        }
    finally:
        shutdown(llm)


def _wait_for(paths: list[Path], process: subprocess.Popen, limit_s: float = 600) -> bool:
    deadline = time.monotonic() + limit_s
    while not all(p.exists() for p in paths):
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def tensor_parallel_race(workdir: str) -> dict:
    from helpers.checkpoints import commit_again

    from tensorizer_manifest.cli.demo import generate_tokens
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    model_a = build_tiny_model(os.path.join(workdir, "tiny-qwen3-tied"), "qwen3-tied")
    model_b = build_tiny_model(os.path.join(workdir, "tiny-qwen3-tied-seed1-own-files"), "qwen3-tied", seed=1)
    # B's files vLLM reads itself differ from A's: its sampling defaults and its tokenizer's length
    Path(model_b, "generation_config.json").write_text(json.dumps(B_GENERATION_CONFIG))
    tokenizer_b = Path(model_b, "tokenizer_config.json")
    config_b = json.loads(tokenizer_b.read_text())
    tokenizer_b.write_text(json.dumps({**config_b, "model_max_length": B_MODEL_MAX_LENGTH}))
    out = os.path.join(workdir, "ckpt-qwen3-tp2-v3")
    tokens_a, saved_a = _capture_save(model_a, out, **TP2)

    gate = Path(workdir, "gate-after-agreement")
    gate.mkdir(exist_ok=True)
    # Its engine core in it (one import of vLLM; its two workers are processes of their own either way).
    env = {
        **os.environ,
        "TENSORIZER_MANIFEST_PAUSE_AT": f"after-agreement:{gate}",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    raced = subprocess.Popen(
        [sys.executable, "-c", _RACED_LOADER, out], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    reached = [gate / f"after-agreement.model-tp{r}-of-2.reached" for r in range(2)]
    paused = _wait_for(reached, raced)
    result: dict = {"tokens_a": tokens_a, "generation_a": saved_a["generation"], "paused_both_ranks": paused}
    try:
        if paused:  # both ranks hold generation A; a re-save of another model commits now, to completion
            result["tokens_b"], saved_b = _capture_save(model_b, out, **TP2)
            result["generation_b"] = saved_b["generation"]
            result["generation_c"] = commit_again(out)
            gc = subprocess.run(
                [sys.executable, "-m", "tensorizer_manifest.cli", "gc", out, "--json"], capture_output=True, text=True
            )
            result["gc"] = json.loads(gc.stdout) if gc.returncode == 0 else {"error": gc.stderr[-2000:]}
    finally:
        (gate / "after-agreement.release").touch()
        output, _ = raced.communicate(timeout=600)
    lines = [line for line in output.splitlines() if line.startswith("RACED ")]
    result["raced"] = json.loads(lines[-1].removeprefix("RACED ")) if lines else None
    if result["raced"] is None:
        result["raced_output"] = output[-4000:]
    report: dict = {}
    result["tokens_after"], _, _ = generate_tokens(out, "tensorizer_manifest", report=report, **TP2)
    result["generation_after"] = report.get("generation")
    return result


def _checkpoint_at(out: str, generation_id: str, target: Path) -> Path:
    """A copy of ``out`` (hard links) whose pointer names ``generation_id``: that save alone, a local checkpoint."""
    import shutil

    from tensorizer_manifest.format.generation import POINTER_NAME, encode_pointer, generation_document_path, pointer_to

    shutil.copytree(out, target, copy_function=os.link)
    document = (target / generation_document_path(generation_id)).read_bytes()
    (target / POINTER_NAME).unlink()
    (target / POINTER_NAME).write_bytes(encode_pointer(pointer_to(generation_id, document)))
    return target


def s3_races(workdir: str, out: str, race: dict) -> dict:
    from helpers.errors import error_chain
    from helpers.servers import BUCKET

    from tensorizer_manifest import upload_checkpoint
    from tensorizer_manifest.cli.demo import generate_tokens
    from tensorizer_manifest.errors import RemoteStorageError
    from tensorizer_manifest.storage.generations import S3Checkpoint
    from tensorizer_manifest.storage.remote import RemoteDir, RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import fetch_model_files

    endpoint, key_id, secret = (os.environ[f"TM_TEST_S3_{k}"] for k in ("ENDPOINT", "KEY_ID", "SECRET"))
    options = RemoteOptions(key_id, secret, endpoint)
    uri = f"s3://{BUCKET}/generations-race-{os.getpid()}"
    store = S3Checkpoint(RemoteDir(uri, options))
    at_a = _checkpoint_at(out, race["generation_a"], Path(workdir, "ckpt-qwen3-tp2-at-a"))
    at_b = _checkpoint_at(out, race["generation_b"], Path(workdir, "ckpt-qwen3-tp2-at-b"))
    gate = Path(workdir, "gate-before-commit")
    gate.mkdir(exist_ok=True)
    writer_a = subprocess.Popen(
        [sys.executable, "-c", _RACING_UPLOAD, str(at_a), uri, f"{key_id},{secret},{endpoint}"],
        env={**os.environ, "TENSORIZER_MANIFEST_PAUSE_AT": f"before-commit:{gate}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    result: dict = {"a_paused": _wait_for([gate / f"before-commit.{race['generation_a']}.reached"], writer_a)}
    try:
        if result["a_paused"]:  # A's files are up; B uploads and commits to completion
            upload_checkpoint(at_b, uri, options)
    finally:
        (gate / "before-commit.release").touch()
        output, _ = writer_a.communicate(timeout=300)
    result["writer_a"] = [line for line in output.splitlines() if line.startswith("UPLOAD ")]
    result["current_after_race"] = store.current_generation_id()

    create = S3Checkpoint.create

    def failing_create(self, relative, data):  # rank 1's manifest upload fails (the connection was reset)
        if relative.endswith("model-tp1-of-2.manifest.json"):
            raise RemoteStorageError(f"{relative}: uploading it failed (the connection was reset)")
        return create(self, relative, data)

    S3Checkpoint.create = failing_create
    try:
        upload_checkpoint(at_a, uri, options)
        result["failed_upload"] = None
    except Exception as exc:  # noqa: BLE001
        result["failed_upload"] = error_chain(exc)
    finally:
        S3Checkpoint.create = create
    result["current_after_failed_upload"] = store.current_generation_id()

    cache = fetch_model_files(uri, Path(workdir, "generations-race-cache"), options)
    loader = {
        "checkpoint_dir": uri,
        "s3_access_key_id": key_id,
        "s3_secret_access_key": secret,
        "s3_endpoint": endpoint,
    }
    report: dict = {}
    result["tokens"], _, _ = generate_tokens(cache, "tensorizer_manifest", report=report, loader_config=loader, **TP2)
    result["generation"] = report.get("generation")
    return result


def main() -> None:
    workdir = sys.argv[1]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # each engine's core in its process: half a TP=2 start
    result = {"one_rank": one_rank(workdir), "race": tensor_parallel_race(workdir)}
    if result["race"].get("generation_b") and os.environ.get("TM_TEST_S3_ENDPOINT"):
        result["s3"] = s3_races(workdir, os.path.join(workdir, "ckpt-qwen3-tp2-v3"), result["race"])
    print("GENERATIONS_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)
