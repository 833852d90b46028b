"""`fivefold doctor --gpu`: refused without a GPU before anything runs; every case runs on the
CPU at test sizes (`--device cpu --quick`), which exercises the code, not a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from fivefold.cli import main
from fivefold.tools import doctor
from fivefold.tools.doctor_cases import CASES, Bench


@pytest.fixture
def nothing_may_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a case ran although the doctor should have refused")

    monkeypatch.setattr(doctor, "run_cases", refuse)


@pytest.mark.parametrize("argv, message", [
    (["doctor", "--gpu"], "doctor --gpu needs a CUDA GPU, but"),
    (["doctor"], "say what to check: fivefold doctor --gpu"),
    (["doctor", "--gpu", "--device", "cpu"], "--device cpu runs the cases at test sizes only; add --quick"),
    (["doctor", "--gpu", "--device", "cpu", "--quick", "--case", "fp64"], "--case 'fp64' is unknown; use one of"),
])
def test_bad_requests_are_refused_in_one_line_before_any_case_runs(argv, message, monkeypatch, capsys, tmp_path,
                                                                  nothing_may_run):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*argv, "--out", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.json").exists()


def test_a_failing_case_is_recorded_with_its_first_line_and_a_bare_assert_with_its_place(tmp_path):
    bench = Bench(torch.device("cpu"), quick=True, scratch=tmp_path)

    def broken(_: Bench):
        raise RuntimeError("the kernel is missing\ndetails nobody reads")

    def bare(_: Bench):
        raise AssertionError  # what a bare assert raises outside pytest's rewriting

    failed = doctor.run_case("broken", broken, bench)
    assert (failed.passed, failed.summary) == (False, "RuntimeError: the kernel is missing")
    summary = doctor.run_case("bare", bare, bench).summary
    assert summary.startswith("AssertionError at test_doctor.py:") and "raise AssertionError" in summary


def test_every_case_runs_end_to_end_on_the_cpu_and_is_reported(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    code = main(["doctor", "--gpu", "--device", "cpu", "--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    failures = {c["name"]: c["summary"] for c in report["cases"] if not c["passed"]}
    assert code == 0 and not failures, failures
    assert [c["name"] for c in report["cases"]] == [name for name, _ in CASES]
    assert report["machine"] == report["machine"] | {"device": "cpu", "quick": True, "torch": torch.__version__}
    cases = {c["name"]: c for c in report["cases"]}
    assert set(cases["SDPA kernels"]["data"]["kernels"]) == {"causal", "causal, grouped heads", "document mask"}
    assert cases["recomputation"]["data"]["none"] == cases["recomputation"]["data"]["full"]
    assert set(cases["tokens/s and MFU"]["data"]["rows"]) >= {"fivefold"}
    assert "11 of 11 cases passed" in capsys.readouterr().out
    assert not torch.are_deterministic_algorithms_enabled()  # the cases that set it leave it as they found it
