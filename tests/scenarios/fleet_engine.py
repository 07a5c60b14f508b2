"""One engine of a fleet: loads a checkpoint from S3 with load_format="tensorizer_manifest" and answers the
demo prompts, in its own process; prints a JSON result on the last line.

Usage: python tests/scenarios/fleet_engine.py URI CACHE_DIR   (URI: s3://, or http:// with no credentials)
with TM_FLEET_ENDPOINT, TM_FLEET_KEY_ID and TM_FLEET_SECRET naming the S3 server and this engine's
credentials (the fleet tests and ``benchmarks/bench_fleet.py`` give each engine its own access key id, so
the proxy in front of the server tells them apart), and TM_FLEET_GATE, a directory: with vLLM imported, the
engine writes its key id there and waits for ``go`` to appear, so that a fleet's engines load at once
(``helpers.fleet``); TM_FLEET_NUM_READERS, when set, is the loader's ``num_readers``. The result has the
tokens, the loader's report (bytes read, seconds) and the load_model time, or, when the engine did not
start, the chain of errors vLLM let through.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers


def main() -> None:
    uri, cache_dir = sys.argv[1], Path(sys.argv[2])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    endpoint, key_id = os.environ["TM_FLEET_ENDPOINT"], os.environ["TM_FLEET_KEY_ID"]
    secret = os.environ["TM_FLEET_SECRET"]

    from helpers.errors import error_chain, error_summary

    from tensorizer_manifest.cli.demo import generate_tokens
    from tensorizer_manifest.storage.remote import RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import fetch_model_files
    from tensorizer_manifest.vllm_integration.loaders import ManifestModelLoader

    seconds: list[float] = []
    original = ManifestModelLoader.load_model

    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    ManifestModelLoader.load_model = timed
    gate = Path(os.environ["TM_FLEET_GATE"])
    (gate / key_id).write_text("ready")
    while not (gate / "go").exists():  # the fleet's engines start together from here
        time.sleep(0.05)
    result: dict = {"key_id": key_id}
    s3 = uri.startswith("s3://")
    extra = {"checkpoint_dir": uri}
    if s3:
        extra.update(s3_access_key_id=key_id, s3_secret_access_key=secret, s3_endpoint=endpoint)
    if os.environ.get("TM_FLEET_NUM_READERS"):
        extra["num_readers"] = int(os.environ["TM_FLEET_NUM_READERS"])
    report: dict = {}
    started = time.perf_counter()
    try:
        model_dir = fetch_model_files(uri, cache_dir, RemoteOptions(key_id, secret, endpoint) if s3 else None)
        result["tokens"], _, _ = generate_tokens(model_dir, "tensorizer_manifest", report=report, loader_config=extra)
        result["engine_started"] = True
    except Exception as exc:  # what vLLM lets through
        result["engine_started"] = False
        result["error"] = error_summary(exc)
        result["chain"] = error_chain(exc)
    result["start_to_answer_seconds"] = time.perf_counter() - started
    result["load_model_seconds"] = seconds[0] if seconds else None
    result["bytes_read"] = report.get("bytes_read")
    print("FLEET_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
