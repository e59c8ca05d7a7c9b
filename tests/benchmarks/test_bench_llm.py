"""The benchmark's language-model train steps (HF transformers' Flax Llama
and GPT-2 with the cross-entropy rule), on tiny sizes (monkeypatched), in
process: every mode runs, the jaxfuse modes replace the head's loss (one
rule site), every record carries its compiled program's memory."""

from __future__ import annotations

import json

import pytest

from jaxfuse_bench import cli, models, reference

LLM = ("llama_train", "llama_train_128k", "gpt2_train", "gpt2_train_128k")


@pytest.fixture()
def tiny(monkeypatch):
    for wl in LLM:  # batch x tokens x width x layers x vocabulary
        size = (2, 9, 64, 2, 512)
        monkeypatch.setitem(models.SIZES, wl, {"quick": size, "cpu": size, "gpu": size})
    monkeypatch.setattr(reference, "buffer_bytes", lambda cache: 16 << 20)


def test_the_llm_workloads_are_registered_with_their_sizes():
    for wl in LLM:
        assert wl in models.MODEL_WORKLOADS and wl in models.BUILDERS
        assert models.SIZE_FORMS[wl] == "batch x tokens x width x layers x vocabulary"
        assert models.REQUIRES[wl] == ("transformers", "optax")
        assert models.SIZES[wl]["cpu"][-1] == (128256 if wl.endswith("128k") else 32000)
        assert models.SIZES[wl]["cpu"][:4] == (4, 256, 256, 2)  # the train step


@pytest.mark.parametrize("wl", ["llama_train", "gpt2_train"])
def test_llm_train_steps_run_with_the_rule(tmp_path, tiny, capsys, wl):
    if models.missing(wl) is not None:
        pytest.skip(models.missing(wl))
    path = tmp_path / "m.json"
    rc = cli.main(["--quick", "--workloads", wl, "--reps", "3", "--warmup", "1",
                   "--ref-reps", "1", "--no-progress", "--timing", "latency", "--json", str(path)])
    assert rc == 0, capsys.readouterr()
    data = json.loads(path.read_text())
    assert data["errors"] == [] and data["skipped"] == []
    recs = {r["mode"]: r for r in data["records"] if r["workload"] == wl}
    assert set(recs) == {"xla", "jaxfuse", "jaxfuse-always"}
    assert recs["xla"]["fused_sites"] == 0
    for mode in ("jaxfuse", "jaxfuse-always"):
        assert recs[mode]["memory"]["temp"] is not None
    assert recs["jaxfuse-always"]["fused_sites"] == 1  # the cross-entropy site
    # at this size the logits fit one chunk: nothing to save, so auto declines it (cost) and
    # compiles jit's program
    assert recs["jaxfuse"]["fused_sites"] == 0
    assert recs["jaxfuse"]["memory"]["temp"] == recs["xla"]["memory"]["temp"]
    assert recs["xla"]["shape"] == [2, 9, 64, 2, 512]
