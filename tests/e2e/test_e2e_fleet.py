"""A fleet from one bucket on real vLLM: four engines start at once from one S3 checkpoint (moto's server on
127.0.0.1, behind a proxy that counts what it sends each engine), with a fifth, at the same time, whose server
stops halfway through the tensor file.

- each of the four answers token for token like vLLM's default loader on the safetensors model;
- each read the tensor file once in full, and its checks read the file's non-data bytes and at most
  ``tensor_file.read_through_budget`` (1 MiB here) more: never a second read of the data. The engines
  load with one reader: with more, tensorizer's first reader keeps the unranged stream, whose transport
  buffers what lies past its span (for a file this small, all of it; docs/design.md, known limits);
- the fifth gets ``RemoteUnreachableError`` naming the URI, starts no engine, and the four are unaffected;
- no credential in anything the engines printed.

One fleet run (five engine processes at once) serves every test here; the checkpoint is the plain llama
e2e scenario's, uploaded as it is.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from helpers.fleet import Engine, engine_key_id, run_fleet
from helpers.servers import BUCKET, Fault, FaultProxy

from tensorizer_manifest.storage.checkpoint import load_manifest, resolve_tensor_file
from tensorizer_manifest.storage.remote import RemoteOptions
from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint
from tensorizer_manifest.storage.tensor_file import read_index

pytestmark = pytest.mark.e2e

SECRET = "fleet-engine-secret-never-shown-7c6b5a49"
HEALTHY = 4


@pytest.fixture(scope="module")
def fleet(scenarios, moto_s3, e2e_dir) -> dict:
    llama = scenarios.e2e("llama")
    local = Path(llama["checkpoint"])
    uri = f"s3://{BUCKET}/fleet-{uuid.uuid4().hex[:8]}"
    upload_checkpoint(local, uri, RemoteOptions(moto_s3.key_id, moto_s3.secret, moto_s3.endpoint))
    manifest, manifest_path = load_manifest(local)
    tensors = resolve_tensor_file(manifest, manifest_path)  # in its generation's folder
    index = read_index(tensors)
    largest = max(index.values(), key=lambda e: e.data_length)
    with FaultProxy(moto_s3) as healthy, FaultProxy(moto_s3) as dying:
        dying.add(Fault(path=tensors.name, ranged=False, stop_after=largest.data_offset + largest.data_length // 2))
        engines = [Engine(healthy.url, engine_key_id(n)) for n in range(HEALTHY)]
        engines.append(Engine(dying.url, engine_key_id(HEALTHY)))
        results = run_fleet(uri, engines, SECRET, e2e_dir / f"fleet-{uuid.uuid4().hex[:6]}", num_readers=1)
        reads = [
            {
                "streams": [r.sent for r in healthy.matching("GET", tensors.name, e.key_id) if r.range is None],
                "fetched": healthy.fetched(tensors.name, e.key_id),
            }
            for e in engines[:HEALTHY]
        ]
        stopped = [r for r in dying.requests if r.fault and r.fault.startswith("stopped")]
    return {
        "uri": uri,
        "tensor_uri": f"{uri}/{tensors.relative_to(local).as_posix()}",
        "reference": llama["reference_tokens"],
        "size": tensors.stat().st_size,
        "non_data": tensors.stat().st_size - sum(e.data_length for e in index.values()),
        "results": results,
        "reads": reads,
        "stopped": len(stopped),
    }


def test_four_engines_at_once_are_token_exact(fleet):
    healthy = fleet["results"][:HEALTHY]
    for result in healthy:
        assert result["engine_started"], result.get("chain") or result["_output"][-3000:]
    assert len(fleet["reference"]) >= 3
    assert [r["tokens"] for r in healthy] == [fleet["reference"]] * HEALTHY


def test_each_engine_reads_the_tensor_file_once_and_its_checks_only_the_non_data_bytes(fleet):
    size, non_data = fleet["size"], fleet["non_data"]
    for result, reads in zip(fleet["results"][:HEALTHY], fleet["reads"], strict=True):
        assert reads["streams"] == [size]  # one full read, no second stream
        checks = reads["fetched"] - size
        assert non_data <= checks <= non_data + max(1 << 20, size // 100), (checks, size, non_data)
        assert result["bytes_read"] == size - non_data  # the loader's own count: every tensor's data, once


def test_an_engine_whose_server_stops_mid_stream_gets_a_typed_error_and_the_others_do_not(fleet):
    failed = fleet["results"][HEALTHY]
    assert fleet["stopped"] == 1
    assert failed["engine_started"] is False and "tokens" not in failed
    assert failed["error"]["error"] == "RemoteUnreachableError", failed["chain"]
    # it names the file it could not read: the tensor file, or (its server gone) the next file of the checkpoint
    assert re.search(rf"{re.escape(fleet['uri'])}/generations/[^ ]+\.(tensors|json)", failed["error"]["message"])
    assert all(r["engine_started"] for r in fleet["results"][:HEALTHY])


def test_no_credential_in_what_any_engine_printed(fleet):
    for result in fleet["results"]:
        at = result["_output"].find(SECRET)
        assert at < 0, result["_output"][max(0, at - 600) : at + 100]
    assert "Loading weights with tensorizer_manifest" in fleet["results"][0]["_output"]  # the logs were captured
