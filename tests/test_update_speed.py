"""benchmarks/update_speed.py: the update's variants timed beside each other, their first steps compared."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import device_check  # noqa: E402
import update_speed  # noqa: E402


def run(tmp_path, variants: str, repeats: int = 1) -> dict:
    out = tmp_path / "update_speed.json"
    update_speed.main(
        ["--dry-run", "--threads", "1", "--repeats", str(repeats), "--variants", variants, "--json", str(out)]
    )
    return json.loads(out.read_text())


def test_the_variants_of_one_update_compute_the_same_gradient_within_bf16s_rounding(tmp_path):
    measured = run(tmp_path, "eager,bf16 casts,padded,plain activations", repeats=2)
    rows = measured["variants"]
    assert list(rows) == ["eager", "bf16 casts", "padded", "plain activations"]
    assert rows["eager"]["gradient_off"] == 0.0  # the reference
    # the same gradient computed another way: bf16 rounds differently, nothing more (on the CPU rows are padded by
    # default: "padded" is the default there, bit for bit)
    assert 0.0 < rows["bf16 casts"]["gradient_off"] < 5e-2
    assert rows["padded"]["gradient_off"] == 0.0
    assert rows["plain activations"]["gradient_off"] == 0.0  # lean norms and activations: the same bits
    for r in rows.values():
        assert len(r["times"]) == 2 and r["median_s"] > 0 and r["mfu"] > 0
    # one learn's FLOPs for every variant (the same tokens, counted once): MFU × seconds is the same. Not MFU < 1: it is
    # against this machine's bf16 matmul, which a CPU without bf16 instructions (AMD Zen 3) emulates, slower than the
    # learn's fp32 parts run (MFU 1.99 seen there, 2026-12-07)
    work = [r["mfu"] * r["median_s"] for r in rows.values()]
    assert max(work) == pytest.approx(min(work), rel=1e-9)
    summary = device_check.update_speed_brief(measured)
    assert summary.startswith("eager ") and "bf16 casts " in summary and "gradient off" in summary


def test_a_variant_that_updates_otherwise_shows_as_off_and_a_failing_one_is_its_row(tmp_path, monkeypatch):
    variants = dict(update_speed.VARIANTS, **{"one minibatch": dict(num_minibatches=1), "broken": dict(epochs=0)})
    monkeypatch.setattr(update_speed, "VARIANTS", variants)
    rows = run(tmp_path, "eager,broken,one minibatch")["variants"]
    assert rows["one minibatch"]["gradient_off"] > 0.3  # its first step's gradient is over all 8 rows, not 4 of them
    assert "error" in rows["broken"] and "epochs and num_minibatches must be >= 1" in rows["broken"]["error"]
    assert len(rows["one minibatch"]["times"]) == 1  # the failure did not end the run
    assert "broken FAILED" in device_check.update_speed_brief({"variants": rows})


def test_unknown_variants_are_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        update_speed.main(["--dry-run", "--variants", "eager,fused"])
    err = capsys.readouterr().err
    assert "fused" in err and "compiled bf16 casts" in err
