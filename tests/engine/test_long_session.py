"""The long session (tools/standin/session.py, tools/long_session.py): contexts, the cost model's
tokens/s, the session's totals, and the tool on the bundled model, its output exact."""

import json

import pytest

from dyno_ui.paths import BUNDLED_MODEL
from helpers.tools import load_tool
from tools.standin.session import doubling, modeled, session_totals


def test_contexts_double_up_to_the_last():
    assert doubling(1024, 32768) == [1024, 2048, 4096, 8192, 16384, 32768]
    assert doubling(1000, 5000) == [1000, 2000, 4000, 5000]
    assert doubling(512, 512) == [512]
    with pytest.raises(ValueError):
        doubling(2048, 1024)


def test_the_cost_model_gives_each_depth_its_tokens_per_second_and_the_session_adds_them_up():
    costs = {"T1": 0.010, "Tv": {1: 0.012, 2: 0.015}, "Td": 0.001}
    got = modeled(costs, (0.8, 0.5), [1, 2])
    assert got["plain"] == pytest.approx(100)
    assert got[1] == pytest.approx(1.8 / 0.013) and got[2] == pytest.approx(2.3 / 0.017)
    # Two turns, one run (its medians count) and one modeled; 10 tokens each.
    turns = [{"measured": {"plain": {"median": 50.0}, "depths": {"1": {"decode_tps": {"median": 100.0}}}}},
             {"modeled_tps": {"plain": 40.0, "1": 20.0}}]
    s = session_totals(turns, [1], 10)
    assert s["decode_s"] == pytest.approx({"plain": 10 / 50 + 10 / 40, "1": 10 / 100 + 10 / 20})
    assert s["speedup"]["1"] == pytest.approx(0.45 / 0.6)
    assert s["best_each_turn_speedup"] == pytest.approx(0.45 / (0.1 + 0.25))  # depth 1, then plain


def test_the_tool_runs_a_short_session_on_the_bundled_model(tmp_path, monkeypatch, capsys):
    tool = load_tool("long_session")
    out = tmp_path / "record.json"
    monkeypatch.setattr("sys.argv", ["long_session.py", "--model", str(BUNDLED_MODEL), "--contexts", "256,512,2048",
                                     "--measure-up-to", "512", "--max-tokens", "12", "--depths", "1,2", "--reps", "1",
                                     "--acceptance", "300:0.9,0.8/2k:0.3,0.2", "--json", str(out)])
    assert tool.main() == 0
    record = json.loads(out.read_text())
    turns = record["turns"]
    assert [t["context"] for t in turns] == [256, 512, 2048]
    assert ["measured" in t for t in turns] == [True, True, False]  # 2048 tokens: the cost model alone
    assert turns[0]["rates"] == [0.9, 0.8] and turns[2]["rates"] == [0.3, 0.2]
    assert turns[1]["rates"] == pytest.approx([0.9 - 0.6 * 212 / 1748, 0.8 - 0.6 * 212 / 1748])
    for t in turns[:2]:  # every run of the turn reproduced the reference (checked inside), and drafted
        assert set(t["measured"]["depths"]) == {"1", "2"}
        assert all(d["tokens_per_round"] > 1 for d in t["measured"]["depths"].values())
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:6] == ["context", "from", "p1", "p2", "p3", "plain"]
    assert [line.split()[:2] for line in lines[2:5]] == [["256", "run"], ["512", "run"], ["2048", "model"]]
    assert lines[-1].startswith("whole session, over plain: depth 1 ")


@pytest.mark.parametrize("argv, message", [
    (["--acceptance", "1k:0.5,0.9"], "acceptance rates must be non-increasing"),
    (["--depths", "4"], "--depths must be from 1 to the profile's 3 positions"),
    (["--contexts", "2048:1024"], "--depths takes numbers like 1,2,3 and --contexts FIRST:LAST"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--contexts", "256,260", "--max-tokens", "8", "--reps", "1", "--depths", "1"],
     "turn 2 of 260 tokens: the session already holds 264"),
])
def test_bad_arguments_get_one_line(monkeypatch, capsys, argv, message):
    tool = load_tool("long_session")
    monkeypatch.setattr("sys.argv", ["long_session.py", "--model", str(BUNDLED_MODEL), *argv])
    with pytest.raises(SystemExit) as e:
        tool.main()
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"long_session.py: error: {message}")


def test_the_tool_builds_a_shape_and_removes_it(tmp_path, monkeypatch, capsys):
    import signal

    tool = load_tool("long_session")
    monkeypatch.setattr("sys.argv", ["long_session.py", "--shape", "qwen3.5-0.8b", "--scaled-down", "--dtype", "float32",
                                     "--root", str(tmp_path), "--contexts", "32,64", "--measure-up-to", "32",
                                     "--max-tokens", "6", "--depths", "1", "--reps", "1", "--acceptance", "27b-long",
                                     "--draft-vocab", "auto", "--json", str(tmp_path.parent / "record.json")])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert tool.main() == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("qwen3.5-0.8b (float32), acceptance 27b-long, 6 tokens a turn, drafts over 256 tokens")
    assert list(tmp_path.iterdir()) == []  # the checkpoint is gone
    record = json.loads((tmp_path.parent / "record.json").read_text())
    costs = record["turns"][1]["cost_model"]  # Td over the 256 rows, the whole vocabulary's kept beside it
    assert record["draft_vocab"] == 256 and {"Td", "Td_whole_vocabulary"} <= set(costs)
