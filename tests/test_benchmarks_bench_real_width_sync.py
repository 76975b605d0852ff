"""benchmarks/bench_real_width_sync.py: the trainer's own sync from a TP2 x EP2 learner through
every CPU transport, the floors, the probes around each sync and the doc section.

The end-to-end test runs the benchmark's ranks phase at a tiny width (the 30B's keys, the real
vocabulary and tokenizer) against the stand-in server, so the code path cannot rot; the real
server at the real widths runs in the benchmark itself (docs/real_geometry.md).
"""

from __future__ import annotations

import sys

import pytest

from benchmarks import bench_real_width_sync as bench
from tests.qwen3_assets import REAL_VOCAB, qwen3_tokenizer_dir, write_tiny  # noqa: F401


def _sync(total, tensors=10, gb=0.001, before=0.5, after=0.001, memcpy=0.1, gloo=0.5,
          **phases):
    return {"weight_sync/total_s": total, "weight_sync/transfer_s": total,
            "weight_sync/gb_per_s": 1.0, "weight_sync/gb": gb, "weight_sync/num_buckets": 2.0,
            "weight_sync/num_tensors": float(tensors), "probe_before": before,
            "probe_after": after, "floor_memcpy_s": memcpy, "floor_gloo_s": gloo,
            "floor_gloo_fresh_s": 2 * gloo, "floor_received": True,
            **{f"weight_sync/{k}_s": v for k, v in phases.items()}}


def _result(syncs_by_transport, tolerance=0.05):
    return {"plan": {"tolerance": tolerance, "num_syncs": 3, "num_bytes": 10**6,
                     "bucket_bytes": 2**20},
            "ranks": {"threads": 1, "transports": {
                name: {"syncs": syncs} for name, syncs in syncs_by_transport.items()}},
            "server_peak_gib": 1.0, "learner_peak_gib": 2.0}


def test_ratio_per_tensor_time_and_profile_are_medians_over_the_syncs():
    result = _result({
        "nccl": [_sync(1.4, gloo=0.7, pack=0.2, pause=0.01), _sync(0.9, pack=0.1, pause=0.03),
                 _sync(1.0, pack=0.3, pause=0.02)],
        "tensor": [_sync(0.3), _sync(0.4), _sync(0.2)]})
    out = bench.summarize(result)
    nccl, tensor = out["nccl"], out["tensor"]
    assert nccl["total_s"] == 1.0 and nccl["floor_s"] == 0.5
    # each sync over the floor measured right before it: 1.4 / 0.7, 0.9 / 0.5, 1.0 / 0.5
    assert nccl["ratios"] == pytest.approx([2.0, 1.8, 2.0]) and nccl["ratio"] == pytest.approx(2.0)
    assert tensor["ratio"] == pytest.approx(0.6) and tensor["ratio_memcpy"] == pytest.approx(3.0)
    assert nccl["per_tensor_us"] == pytest.approx((1.0 - 0.5) / 10 * 1e6)
    assert nccl["phases"] == pytest.approx({"pack": 0.2, "pause": 0.02})
    assert (nccl["num_bytes"], nccl["num_buckets"], nccl["num_tensors"]) == (10**6, 2, 10)
    assert nccl["probe_ok"] and tensor["probe_ok"]
    text = bench.section(result, out, ["--work", "w"], {"date": "today"})
    assert "| nccl | 2 | 10 | 1.00 (1.40, 0.90, 1.00) | 0.100 | 0.500 | 1.000 | " \
           "**2.00x** (2.00, 1.80, 2.00) | 10.00x | 50.00 ms |" in text
    assert "| nccl | pack 0.20, protocol 0.02 |" in text
    assert "met by nccl, tensor." in text
    slow = bench.summarize(_result({"disk": [_sync(1.5)]}))
    assert "met by none; not by disk." in bench.section(result, slow, [], {})


def test_a_probe_that_cannot_tell_stale_weights_or_misses_new_ones_fails():
    blind = bench.summarize(_result({"disk": [_sync(1.0, before=0.04)]}))  # stale looked fine
    missed = bench.summarize(_result({"disk": [_sync(1.0, after=0.2)]}))  # new did not arrive
    assert not blind["disk"]["probe_ok"] and not missed["disk"]["probe_ok"]


def test_write_doc_replaces_only_the_marked_section(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"head\n{bench.BEGIN}\nold\n{bench.END}\ntail\n")
    bench.write_doc(doc, f"{bench.BEGIN}\nnew\n{bench.END}")
    assert doc.read_text() == f"head\n{bench.BEGIN}\nnew\n{bench.END}\ntail\n"


@pytest.mark.slow
def test_every_transport_syncs_a_tp2_ep2_learner_into_a_server(tmp_path,
                                                              qwen3_tokenizer_dir):  # noqa: F811
    from gspo_megatron.distributed.ports import free_port
    from gspo_megatron.rollout.sglang.engine import SGLangEngine
    from gspo_megatron.rollout.sglang.launcher import ServerLauncher
    from gspo_megatron.rollout.standin.launcher import reference_server_command
    from gspo_megatron.weight_sync.server_model import checkpoint_shapes

    model = write_tiny(tmp_path / "model", qwen3_tokenizer_dir, vocab_size=REAL_VOCAB)
    port = free_port()
    launcher = ServerLauncher(str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    launcher.start(reference_server_command(str(model), port, python=sys.executable),
                   f"127.0.0.1:{port}")
    try:
        SGLangEngine(launcher.addresses, request_timeout_s=60).wait_healthy(120)
        result = bench.run_syncs(model, launcher.addresses[0], launcher.servers[0].process.pid,
                                 [1, 2, 3, 4, 5, 6], tmp_path / "run", num_syncs=2,
                                 bucket_bytes=2**20, timeout_s=600)
    finally:
        launcher.stop()
    out = bench.summarize(result)
    assert list(out) == list(bench.TRANSPORTS)
    num_bytes = bench.checkpoint_bytes(model)
    for name, s in out.items():
        assert s["num_bytes"] == num_bytes and s["num_tensors"] == len(checkpoint_shapes(model))
        assert s["num_buckets"] >= 3, s  # the 19 MB embedding and lm_head exceed a bucket
        assert s["probe_ok"], s["probes"]  # stale weights seen before, new ones after
        assert s["floor_received"] and s["memcpy_s"] > 0 and s["floor_s"] > 0
        assert s["gloo_fresh_s"] > 0
        assert {"gather", "send", "reply", "pause", "flush"} <= set(s["phases"]), s["phases"]
    assert {"pack", "broadcast"} <= set(out["nccl"]["phases"])
    assert {"pack", "serialize"} <= set(out["tensor"]["phases"])
    assert "write" in out["disk"]["phases"] and "connect" in out["nccl"]["phases"]
    assert result["server_peak_gib"] > 0 and result["learner_peak_gib"] > 0
