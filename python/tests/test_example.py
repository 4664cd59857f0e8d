"""examples/python/train_under_attack.py, short: 8 ranks under `byzcoll launch`, 2 Byzantine.
The mean collapses under the sign-flip attack and refuses the NaN one; the median, the trimmed
mean and Krum reach within a few points of the attack-free accuracy under both. And
examples/python/ddp_under_attack.py, short: a DDP model with the median hook, in float32 and
bfloat16."""

import json
import os
import subprocess
import sys

import pytest
from helpers import clean_env, free_port

pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("sklearn", reason="scikit-learn is not installed")
pytest.importorskip("matplotlib", reason="matplotlib is not installed")

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python", "train_under_attack.py")


def test_robust_rules_train_through_attacks_the_mean_does_not(tmp_path):
    cli = os.environ.get("BYZCOLL_BIN")
    if not cli or not os.path.exists(cli):
        assert not os.environ.get("BYZCOLL_REQUIRE_MPI"), "BYZCOLL_BIN must name the byzcoll binary in CI"
        pytest.skip("BYZCOLL_BIN (the byzcoll CLI) is not set")
    out, png = tmp_path / "results.json", tmp_path / "results.png"
    env = clean_env(OMP_NUM_THREADS="1")
    p = subprocess.run(
        [cli, "launch", "-n", "8", "--", sys.executable, EXAMPLE, "--steps", "50",
         "--rules", "mean,median,trimmed-mean,krum", "--attacks", "none,sign-flip,nan",
         "--out", str(out), "--plot", str(png)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads(out.read_text())["results"]
    assert png.stat().st_size > 10_000
    clean = results["mean"]["none"]["accuracy"][-1]
    assert clean > 0.85, results["mean"]["none"]
    flipped = results["mean"]["sign-flip"]
    assert "error" in flipped or flipped["accuracy"][-1] < 0.5, flipped
    assert "non-finite" in results["mean"]["nan"].get("error", ""), results["mean"]["nan"]
    for rule in ["median", "trimmed-mean", "krum"]:
        for attack in ["none", "sign-flip", "nan"]:
            h = results[rule][attack]
            assert "error" not in h, (rule, attack, h.get("error"))
            assert h["accuracy"][-1] >= clean - 0.06, (rule, attack, h["accuracy"][-1], clean)


def test_a_bfloat16_model_trains_through_the_attacks_as_a_float32_one_does(tmp_path):
    """`--dtype bfloat16`: the model, its gradients and the rounds in bf16 (two bytes per
    element on the wire); the median holds under the sign-flip and NaN attacks as in f32."""
    cli = os.environ.get("BYZCOLL_BIN")
    if not cli or not os.path.exists(cli):
        assert not os.environ.get("BYZCOLL_REQUIRE_MPI"), "BYZCOLL_BIN must name the byzcoll binary in CI"
        pytest.skip("BYZCOLL_BIN (the byzcoll CLI) is not set")
    out = tmp_path / "results.json"
    p = subprocess.run(
        [cli, "launch", "-n", "8", "--", sys.executable, EXAMPLE, "--steps", "50", "--dtype", "bfloat16",
         "--rules", "median", "--attacks", "none,sign-flip,nan", "--out", str(out)],
        env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    run = json.loads(out.read_text())
    assert run["dtype"] == "bfloat16"
    results = run["results"]["median"]
    clean = results["none"]["accuracy"][-1]
    assert clean > 0.85, results["none"]
    for attack in ["sign-flip", "nan"]:
        h = results[attack]
        assert "error" not in h, (attack, h.get("error"))
        assert h["accuracy"][-1] >= clean - 0.06, (attack, h["accuracy"][-1], clean)


DDP_EXAMPLE = os.path.join(os.path.dirname(EXAMPLE), "ddp_under_attack.py")


def test_a_bfloat16_ddp_model_trains_with_the_median_hook_as_a_float32_one_does(tmp_path):
    """examples/python/ddp_under_attack.py, short: DistributedDataParallel over gloo on 4 ranks,
    the median hook, the last rank Byzantine. Under sign-flip and NaN the model trains as
    without an attack, bfloat16 within 2 points of float32, and the NaN sender is named."""
    cli = os.environ.get("BYZCOLL_BIN")
    if not cli or not os.path.exists(cli):
        assert not os.environ.get("BYZCOLL_REQUIRE_MPI"), "BYZCOLL_BIN must name the byzcoll binary in CI"
        pytest.skip("BYZCOLL_BIN (the byzcoll CLI) is not set")
    out = tmp_path / "ddp.json"
    p = subprocess.run(
        [cli, "launch", "-n", "4", "--", sys.executable, DDP_EXAMPLE, "--port", str(free_port()),
         "--steps", "60", "--out", str(out)],
        env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads(out.read_text())["results"]
    for dtype in ["float32", "bfloat16"]:
        clean = results[dtype]["none"]["accuracy"]
        assert clean > 0.85, (dtype, results[dtype])
        for attack in ["sign-flip", "nan"]:
            assert results[dtype][attack]["accuracy"] >= clean - 0.06, (dtype, attack, results[dtype])
        assert results[dtype]["nan"]["non_finite"] == [3], results[dtype]["nan"]
    for attack in ["none", "sign-flip", "nan"]:
        f32, bf16 = results["float32"][attack]["accuracy"], results["bfloat16"][attack]["accuracy"]
        assert abs(bf16 - f32) <= 0.02, (attack, f32, bf16)
