"""``sagaline catalogue check`` (R4) and ``sagaline plan check`` (R17) from the shell.

Fixture modules live in ``tests/fixtures/``; the CLI imports them from the working
directory, as ``python -m`` would, so every test runs from the repository root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import main

ROOT = Path(__file__).resolve().parents[1]
GOOD = "tests.fixtures.participants_good"
BAD = "tests.fixtures.participants_bad"


@pytest.fixture(autouse=True)
def _from_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def test_catalogue_check_prints_the_table_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["catalogue", "check", GOOD]) == 0
    out = capsys.readouterr().out
    assert "participant refunds: 5 tool(s), all declarations valid" in out
    header = out.splitlines()[1].split()
    assert header[:7] == [
        "tool",
        "reversibility",
        "compensation",
        "lookup",
        "verify",
        "pivot",
        "approval",
    ]
    [hold] = [line.split() for line in out.splitlines() if line.startswith("place_hold")]
    assert hold[:4] == ["place_hold", "REVERSIBLE", "release_hold", "find_hold"]
    [credit] = [line.split() for line in out.splitlines() if line.startswith("issue_credit")]
    assert credit[1] == "IRREVERSIBLE" and "yes" in credit and "required" in credit


def test_catalogue_check_with_a_typo_in_by_exits_1_naming_tool_and_method(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """R4 / issue acceptance: a typo in by= fails the check, naming both."""
    assert main(["catalogue", "check", BAD]) == 1
    err = capsys.readouterr().err
    assert 'reserve_inventory: @compensable(by="relase_inventory")' in err
    assert "did you mean 'release_inventory'?" in err
    assert "charge_card: is a write tool with no declared compensation (R4)" in err


def test_catalogue_check_as_a_subprocess_exits_1_naming_tool_and_method() -> None:
    """The same check as a person or CI runs it: a separate process, its exit code."""
    script = Path(sys.executable).with_name("sagaline")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "services.cli"]
    done = subprocess.run(
        [*command, "catalogue", "check", BAD],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "reserve_inventory" in done.stderr and "relase_inventory" in done.stderr


def test_catalogue_check_reports_a_module_that_fails_wrap_at_import(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["catalogue", "check", "tests.fixtures.participants_wrapped_at_import"]) == 1
    err = capsys.readouterr().err
    assert "authorize:" in err and "'void_authorisation'" in err
    assert "did you mean 'void_authorization'?" in err


def test_catalogue_check_accepts_module_and_attribute(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["catalogue", "check", f"{GOOD}:PARTICIPANTS", "--name", "atlas"]) == 0
    assert "participant atlas: 5 tool(s)" in capsys.readouterr().out


def test_catalogue_check_json_prints_the_contracts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["catalogue", "check", GOOD, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["participant"] == "refunds"
    assert data["tools"]["issue_credit"]["pivot"] is True


def test_catalogue_check_of_a_missing_module_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["catalogue", "check", "tests.fixtures.no_such_module"]) == 2
    assert "cannot import 'tests.fixtures.no_such_module'" in capsys.readouterr().err


def test_catalogue_check_of_a_module_without_participants_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["catalogue", "check", "tests.fixtures"]) == 2
    assert "holds no participant" in capsys.readouterr().err


def test_catalogue_check_passes_over_a_module_object_that_raises_when_inspected(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A module-level lazy object (``django.conf.settings`` unconfigured) raised out
    of the scan for participants, ending the command in a traceback; it is no
    participant, and the module's participant is found."""
    assert main(["catalogue", "check", "tests.fixtures.participants_beside_a_lazy_object"]) == 0
    assert "find_order" in capsys.readouterr().out


def write_plan(tmp_path: Path, calls: list[dict[str, object]]) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"module": GOOD, "calls": calls}))
    return path


def test_plan_check_of_a_well_ordered_plan_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = write_plan(
        tmp_path,
        [
            {"tool": "place_hold", "args": {"order_id": "o-1"}},
            {"tool": "issue_credit", "args": {"order_id": "o-1", "amount_cents": 400000}},
            {"tool": "send_email", "args": {"order_id": "o-1", "body": "refunded"}},
        ],
    )
    assert main(["plan", "check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "0 error(s)" in out and out.rstrip().endswith("OK")


def test_plan_check_with_irreversible_before_fallible_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """R17: the email before the hold is flagged; the check fails."""
    plan = write_plan(
        tmp_path,
        [
            {"tool": "send_email", "args": {"order_id": "o-1", "body": "refunded"}},
            {"tool": "place_hold", "args": {"order_id": "o-1"}},
        ],
    )
    assert main(["plan", "check", str(plan)]) == 1
    out = capsys.readouterr().out
    assert "ERROR IRREVERSIBLE_BEFORE_FALLIBLE step 0 send_email" in out


def test_plan_check_json_lists_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path, [{"tool": "nope", "args": {}}])
    assert main(["plan", "check", str(plan), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["findings"][0]["code"] == "UNKNOWN_TOOL"


def test_plan_check_of_an_unreadable_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "plan.json"
    broken.write_text("{not json")
    assert main(["plan", "check", str(broken)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_plan_check_of_a_call_that_is_not_an_object_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan file is unreadable (exit 2) when a call is not a {"tool", "args"} object;
    a bare tool name used to end the command in an AttributeError traceback. The
    message points at the call without echoing argument values (they may be secret)."""
    plan = write_plan(tmp_path, ["place_hold", {"name": "send_email", "args": {"pin": "4321"}}])
    assert main(["plan", "check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "call 0" in err and "'place_hold'" in err and "object" in err

    plan = write_plan(tmp_path, [{"name": "send_email", "args": {"pin": "4321"}}])
    assert main(["plan", "check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "call 0" in err and "'tool'" in err and "4321" not in err


def test_catalogue_check_of_a_factory_that_fails_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A factory that raises (a setting it reads is missing) ended the command in a
    traceback; it is reported like a module that fails to import."""
    reference = "tests.fixtures.participants_factory_fails:make_catalogue"
    assert main(["catalogue", "check", reference]) == 2
    err = capsys.readouterr().err
    assert f"{reference}() failed: KeyError" in err
    assert "SAGALINE_TEST_PAYMENTS_URL_THAT_IS_NEVER_SET" in err


def test_catalogue_check_refuses_a_name_it_cannot_apply(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A module providing a ready Catalogue keeps the name wrap() gave it: --name was
    silently ignored, the table said 'participant refunds' for --name billing."""
    assert (
        main(["catalogue", "check", "tests.fixtures.participants_ready", "--name", "billing"]) == 2
    )
    err = capsys.readouterr().err
    assert "--name 'billing'" in err and "'refunds'" in err, err


def test_catalogue_check_with_an_empty_name_is_refused_not_taken_as_no_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--name '' (an unset variable in a script) counted as not given: the objects were
    wrapped as PARTICIPANT_NAME and the check passed."""
    assert main(["catalogue", "check", GOOD, "--name", ""]) == 1
    err = capsys.readouterr().err
    assert "participant name ''" in err, err


def test_catalogue_check_of_a_factory_of_several_catalogues_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A zero-argument factory returning a list of Catalogues (one per participant, as
    the drill takes) was wrapped as participant objects: 'Catalogue has no method
    decorated with @tool', exit 1, as if the tools were not declared."""
    assert main(["catalogue", "check", "tests.fixtures.participants_ready:several"]) == 2
    err = capsys.readouterr().err
    assert "@tool" not in err and "2 catalogues" in err and "several()" in err, err


@pytest.mark.parametrize(
    ("naming", "wrong"),
    [
        ({"modules": [GOOD, 3]}, "'modules' entry 1 is 3"),
        ({"modules": GOOD}, "'modules' is 'tests.fixtures.participants_good'"),
        ({"module": ["a", "b"]}, "'module' is ['a', 'b']"),
    ],
)
def test_plan_check_of_a_catalogue_named_wrongly_says_what_is_wrong(
    naming: dict[str, object], wrong: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 'modules' list with a non-string entry (or a 'modules' string, a 'module'
    list) was reported as 'names no catalogue; add "module": ...', though it named
    one."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**naming, "calls": []}))
    assert main(["plan", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert wrong in err and "names no catalogue" not in err, err
