"""verify-kernels: passes an honest restorer on real vLLM, fails a broken one, and counts steps honestly."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_wna16
from helpers.terminal import typed

from tensorizer_manifest.cli.verify_kernels import recording_post_load


class _Method:
    def process_weights_after_loading(self, layer):
        layer.done = True


class _Subclass(_Method):
    pass


def test_recording_post_load_sees_each_layer_a_step_ran_on_and_puts_the_classes_back():
    original = _Method.__dict__["process_weights_after_loading"]
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    with recording_post_load({_Method, _Subclass}) as stepped:
        _Subclass().process_weights_after_loading(a)
    assert stepped == {id(a)} and a.done and not hasattr(b, "done")
    assert _Method.__dict__["process_weights_after_loading"] is original
    assert "process_weights_after_loading" not in _Subclass.__dict__


@pytest.fixture(scope="module")
def gptq_model(e2e_dir):
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    return build_tiny_model(e2e_dir / "tiny-gptq-w4", "gptq-w4")


@pytest.mark.e2e
@needs_wna16
def test_verify_kernels_passes_the_cpu_restorers_and_writes_records(gptq_model, tmp_path):
    from tensorizer_manifest.format.verification_records import read_records

    out = tmp_path / "records.json"  # as scripts/verify_kernels.py asks for them, typed on a terminal
    shown = typed("verify-kernels", str(gptq_model), "--dtype", "bfloat16", "--work-dir", str(tmp_path / "w"),
                  "--record-out", str(out), timeout=900)  # fmt: skip
    assert shown.returncode == 0, shown.output[-3000:]
    assert "Traceback" not in shown.output, shown.output[-3000:]
    records = {r.restorer: r for r in read_records(out)}
    assert records and all(f"pass {name} on cpu" in shown.flat for name in records), shown.output[-3000:]
    wna16 = records["cpu_wna16"]
    assert (wna16.result, wna16.device_type, wna16.layers) == ("pass", "cpu", 8)
    assert wna16.kernel_classes and all("CPUWNA16LinearKernel" in k or "GPTQ" in k for k in wna16.kernel_classes)
    assert wna16.form and all("use_w4a8" in f for f in wna16.form)
    assert all(r.result == "pass" and r.detail == "" for r in records.values())


@pytest.mark.e2e
@needs_wna16
def test_verify_kernels_fails_a_restorer_that_transforms_a_tensor_again(gptq_model, tmp_path):
    from conftest import run_script

    records = run_script("scenarios/verify_sabotaged.py", str(gptq_model), str(tmp_path), marker="VERIFY_RESULT")
    by_name = {r["restorer"]: r for r in records}
    assert by_name["cpu_wna16"]["result"] == "fail"
    assert "processed tensors differ" in by_name["cpu_wna16"]["detail"]
    assert "scales: bytes differ" in by_name["cpu_wna16"]["detail"]
    assert by_name["attention_scales"]["result"] == "fail"  # the tokens differ, so no record of that run passes
