"""The learner's loop: predictions locked before answers, and the local progress record."""

from __future__ import annotations

import ast
import json
import os
import re

import nbformat
import pytest

from kvlab.learner.prediction import Prediction, interactive, parse_number, predict
from kvlab.learner.store import Store, home, store
from notebook_run import execute


@pytest.fixture
def kvhome(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def widget_mode(monkeypatch, kvhome):
    monkeypatch.setenv("KVLAB_PREDICT", "widget")
    return kvhome


# -- the store ---------------------------------------------------------------------------------
def test_store_lives_in_kvlab_home_and_records_passes(kvhome):
    assert home() == kvhome and store().path == kvhome / "progress.json"
    assert store().passed() == {} and not (kvhome / "progress.json").exists()  # reading writes nothing
    store().record_pass("touch")
    store().record_pass("touch")
    store().record_pass("free_order")
    passed = store().passed()
    assert sorted(passed) == ["free_order", "touch"] and passed["touch"]["count"] == 2
    data = json.loads((kvhome / "progress.json").read_text())
    assert data["version"] == 1


def test_home_defaults_to_dot_kvlab(monkeypatch, tmp_path):
    monkeypatch.delenv("KVLAB_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert home() == tmp_path / ".kvlab"


def test_predictions_update_by_uid(kvhome):
    s = store()
    s.record_prediction({"uid": "a", "prediction": 3})
    s.record_prediction({"uid": "b", "prediction": "x"})
    s.record_prediction({"uid": "a", "result": 4, "matched": False})
    assert s.predictions() == [{"uid": "a", "prediction": 3, "result": 4, "matched": False}, {"uid": "b", "prediction": "x"}]
    with pytest.raises(ValueError, match="uid"):
        s.record_prediction({"prediction": 1})


def test_a_corrupt_file_is_moved_aside_not_lost(kvhome):
    kvhome.mkdir()
    (kvhome / "progress.json").write_text("{not json")
    with pytest.warns(UserWarning, match="was not valid"):
        assert store().passed() == {}
    (bad,) = kvhome.glob("progress.json.bad-*")
    assert bad.read_text() == "{not json"
    (kvhome / "progress.json").write_text(json.dumps({"version": 99, "passed": {}, "predictions": []}))
    with pytest.warns(UserWarning, match="version 99"):
        store().record_pass("touch")
    assert list(store().passed()) == ["touch"]


def test_an_unwritable_home_warns_and_never_breaks_a_check(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVLAB_HOME", str(blocker / "sub"))  # a folder under a file: cannot exist
    from kvlab.exercises import check

    with pytest.warns(UserWarning, match="could not record"):
        res = check("free_order", lambda blocks: blocks[::-1])
    assert res


def test_store_refuses_bad_arguments(kvhome):
    with pytest.raises(ValueError, match="path"):
        Store("")
    with pytest.raises(ValueError, match="exercise_id"):
        store().record_pass("")


def test_check_records_only_passes(kvhome):
    from kvlab.exercises import check

    assert not check("free_order", lambda blocks: list(blocks))
    assert store().passed() == {}
    assert check("free_order", lambda blocks: blocks[::-1])
    assert list(store().passed()) == ["free_order"]


# -- the mode ----------------------------------------------------------------------------------
def test_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVLAB_PREDICT", "plain")
    assert interactive() is False
    monkeypatch.setenv("KVLAB_PREDICT", "widget")
    assert interactive() is True
    monkeypatch.setenv("KVLAB_PREDICT", "sometimes")
    with pytest.raises(ValueError, match="'plain' or 'widget'"):
        interactive()


def test_mode_follows_the_front_end(monkeypatch):
    """Unset: a kernel whose cell came from a front end that answers input() is interactive;
    one driven by nbclient/nbval (allow_stdin=False) is not; no kernel at all is not."""
    monkeypatch.delenv("KVLAB_PREDICT", raising=False)
    import IPython

    class Kernel:
        _allow_stdin = True

    class Shell:
        kernel = Kernel()

    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell())
    assert interactive() is True
    Kernel._allow_stdin = False
    assert interactive() is False
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    assert interactive() is False


# -- plain mode: the answer prints as text (what CI and the stored notebooks see) ---------------
def test_plain_mode_prints_question_and_lets_the_answer_through(monkeypatch, kvhome, capsys):
    monkeypatch.setenv("KVLAB_PREDICT", "plain")
    p = predict("How many blocks will `r2` get?", kind="number")
    with p.reveal():
        print("r2 gets [5]")
        p.result = 1
    assert capsys.readouterr().out == "✎ Predict: How many blocks will `r2` get?\nr2 gets [5]\n"
    q = predict("Which?", choices=["head", "tail"])
    assert capsys.readouterr().out == "✎ Predict: Which?  [head / tail]\n"
    assert q.answer_kind == "choice" and store().predictions() == []  # nothing locked, nothing recorded


# -- widget mode: hidden until locked ------------------------------------------------------------
def test_answer_hidden_until_locked_then_prediction_beside_result(widget_mode, capsys):
    p = predict("How many blocks will r2 get?", kind="number")
    with p.reveal() as r:
        print("the answer: 1 block")
        p.result = 1
    assert r.done and not r.visible  # ran, but hidden
    field, button = p._widgets["field"], p._widgets["button"]
    assert button.disabled
    field.value = "two"
    assert button.disabled and "not a number" in p._widgets["status"].value
    field.value = "2"
    assert not button.disabled
    button.click()
    assert p.locked and r.visible and field.disabled and button.description == "Locked"
    assert p.summary() == "your prediction: 2 · result: 1 · ✘ not this time (off by 1)"
    assert "✘ not this time" in r._header.value
    (rec,) = store().predictions()
    assert rec["prediction"] == 2.0 and rec["result"] == 1 and rec["matched"] is False and rec["kind"] == "number"


def test_locking_before_the_answer_cell_runs(widget_mode):
    p = predict("Which block is evicted first?", choices=["1", "5"])
    p.lock("5")
    with p.reveal() as r:
        p.result = 5
    assert r.visible and p.matched() is True
    (rec,) = store().predictions()
    assert rec["matched"] is True and rec["result"] == 5  # the result arrived after the lock


def test_tolerances_text_and_relock(widget_mode):
    p = predict("Roughly how full?", kind="number", rel_tol=0.1)
    p.lock("92 %")
    p.result = 100.0
    assert p.matched() is True
    p.result = 80
    assert p.matched() is False
    with pytest.raises(RuntimeError, match="already locked"):
        p.lock(5)
    t = predict("What happens to the hash?")
    with pytest.raises(ValueError, match="write your prediction"):
        t.lock("   ")
    t.lock("it stays")
    t.result = "kept"
    assert t.matched() is None and t.summary() == "your prediction: it stays · result: kept"


def test_an_error_in_the_answer_cell_opens_its_area(widget_mode):
    p = predict("?", kind="text")
    with pytest.raises(ZeroDivisionError):
        with p.reveal() as r:
            1 / 0
    assert r.visible  # the learner sees what went wrong even before locking


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(question=""), "question"),
        (dict(question="q", kind="guess"), "kind must be one of"),
        (dict(question="q", kind="choice"), "at least 2"),
        (dict(question="q", choices=["a", "a"]), "distinct"),
        (dict(question="q", kind="number", choices=["a", "b"]), "only for kind='choice'"),
        (dict(question="q", kind="number", tol=-1), "tol must be"),
        (dict(question="q", rel_tol=0.1), "for kind='number'"),
        (dict(question="q", id=""), "id must be"),
    ],
)
def test_predict_refuses_bad_arguments(kwargs, match, widget_mode):
    with pytest.raises(ValueError, match=match):
        Prediction(**kwargs)


def test_parse_number():
    assert parse_number(" 1,533 ") == 1533 and parse_number("97.3 %") == 97.3
    for bad in ("", "abc", "nan", "inf"):
        with pytest.raises(ValueError):
            parse_number(bad)


def test_lesson_name_from_the_jupyter_session(widget_mode, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/my-kvlab/notebooks/04_refcounts.ipynb")
    p = predict("q", kind="number", id="blocks")
    p.lock(3)
    (rec,) = store().predictions()
    assert rec["lesson"] == "04_refcounts" and rec["key"] == "blocks"


def test_a_locked_prediction_comes_back_locked_after_a_kernel_restart(widget_mode, monkeypatch):
    """The learner's record, not kernel memory, says what was locked: the same question of the
    same lesson comes back locked with its answer open; another lesson's question does not."""
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/my-kvlab/notebooks/03_prefix_caching.ipynb")
    p = predict("How many blocks hit?", kind="number")
    p.lock("2")
    with p.reveal():
        p.result = 3
    (first,) = store().predictions()
    # "a kernel restart": new Prediction objects, same record
    q = predict("How many blocks hit?", kind="number")
    assert q.locked and q.value == 2.0 and q.uid == first["uid"] and q.restored and q.locked_at == first["locked_at"]
    field, button, status, again = (q._widgets[k] for k in ("field", "button", "status", "again"))
    assert field.value == "2" and field.disabled and button.description == "Locked"
    assert "(from your record)" in status.value and "<b>2</b>" in status.value and again.layout.display is None
    with q.reveal() as r:
        print("3 blocks")
        q.result = 3
    assert r.visible and q.summary() == "your prediction: 2 · result: 3 · ✘ not this time (off by 1)"
    (rec,) = store().predictions()  # the same entry, updated: no second prediction counted
    assert rec["uid"] == first["uid"] and rec["locked_at"] == first["locked_at"] and rec["result"] == 3
    # "Predict again": the answer hides, the form opens; the new lock is a new entry
    again.click()
    assert not q.locked and not r.visible and not field.disabled and again.layout.display == "none"
    assert button.description == "Lock in" and not button.disabled  # "2" is still a valid number
    field.value = "3"
    button.click()
    assert q.locked and r.visible and q.matched() is True and len(store().predictions()) == 2
    # another lesson, another kind or a choice no longer offered: not restored
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/my-kvlab/notebooks/04a_refcounts.ipynb")
    assert not predict("How many blocks hit?", kind="number").locked
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/my-kvlab/notebooks/03_prefix_caching.ipynb")
    assert predict("How many blocks hit?", kind="number").value == 3.0  # the newest lock
    assert not predict("How many blocks hit?", choices=["2", "4"]).locked


def test_no_lesson_name_no_restore(widget_mode, monkeypatch):
    """Without the Jupyter session's notebook name a question cannot be told apart from the
    same question in another lesson: it is asked afresh."""
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    predict("Which?", choices=["a", "b"]).lock("a")
    assert not predict("Which?", choices=["a", "b"]).locked


@pytest.mark.notebook
def test_a_kernel_driven_by_nbclient_prints_plain_text(tmp_path):
    """No KVLAB_PREDICT at all: nbclient sends allow_stdin=False, so the answer cell prints
    its text -- what `# NBVAL_CHECK_OUTPUT` compares -- and no widget is created."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell('from kvlab.learner import predict\np = predict("How many?", kind="number")'),
        nbformat.v4.new_code_cell("with p.reveal():\n    print(42)"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "KVLAB_PREDICT"}
    old = os.environ.copy()
    os.environ.clear()
    os.environ.update(env)
    try:
        execute(nb, timeout=60, kernel_name="python3")
    finally:
        os.environ.clear()
        os.environ.update(old)
    outs = [[o.get("text", "") for o in c.outputs] for c in nb.cells]
    assert outs == [["✎ Predict: How many?\n"], ["42\n"]]


def test_a_lessons_result_must_fit_its_kind(widget_mode):
    """A result that can never match (not a number; not one of the choices) is the lesson
    author's mistake: it fails where the lesson runs (nbval), not silently for learners."""
    p = predict("Which?", choices=["head", "tail"])
    with pytest.raises(ValueError, match="not one of the choices"):
        with p.reveal():
            p.result = "middle"
    q = predict("How many?", kind="number")
    with pytest.raises(ValueError, match="not a number"):
        with q.reveal():
            q.result = "three"
    r = predict("How many?", kind="number")
    with r.reveal():
        r.result = 3
    from kvlab.learner.prediction import ASKED

    assert ASKED[-3:] == [p, q, r]


def test_hints_are_buttons_in_jupyterlab_and_a_note_elsewhere(monkeypatch):
    """A stored lesson must not show a widget repr (its model is gone when reopened), nor the
    hints' text: in plain mode a hints cell shows how many hints there are."""
    from kvlab.exercises import hints

    monkeypatch.setenv("KVLAB_PREDICT", "plain")
    note = hints("touch")
    assert repr(note) == "3 hints for touch: run this cell in JupyterLab to open them one at a time"
    monkeypatch.setenv("KVLAB_PREDICT", "widget")
    box = hints("touch")
    import ipywidgets as w

    # a VBox of buttons that displays itself after a still (the note): no widget error in a reopened lesson
    assert type(box).__name__ == "HintsBox" and isinstance(box, w.VBox) and box.children[0].description == "Show hint 1"
    with pytest.raises(ValueError, match="unknown exercise_id"):
        hints("nope")


# -- the lessons ---------------------------------------------------------------------------------
LESSONS = sorted((__import__("pathlib").Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _prompts(path):
    """(markdown prompts, the code cell after each) of one lesson: a prompt is a markdown cell
    with a bold '**Predict' that asks the learner to commit ('**Predict first.**', lesson 00's
    description of the loop, is not one)."""
    import re

    cells = nbformat.read(path, as_version=4).cells
    out = []
    for i, c in enumerate(cells):
        if c.cell_type == "markdown" and re.search(r"\*\*Predict(, then run|:)", c.source):
            out.append((c, next((d for d in cells[i + 1 :] if d.cell_type == "code"), None), cells[i + 1 :]))
    return out


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_predict_prompt_takes_the_prediction_before_the_answer(path):
    """Issue 15: every 'Predict' prompt of a lesson is followed by a predict() cell, and that
    prediction's answer cell runs under ``guess.reveal()`` (hidden until the guess is locked)."""
    for prompt, nxt, rest in _prompts(path):
        where = prompt.source.splitlines()[-1][:60]
        assert nxt is not None and "predict(" in nxt.source, f"{path.name}: a prompt with no predict() after it: {where!r}"
        following = [c for c in rest if c.cell_type == "code"][1:]
        upto = next((k for k, c in enumerate(following) if "predict(" in c.source), len(following))
        assert any("guess.reveal()" in c.source for c in following[:upto]), (
            f"{path.name}: the answer to {where!r} is not under guess.reveal()"
        )


def test_lessons_01_to_14_each_ask_for_predictions():
    counts = {p.stem[:3].rstrip("_"): len(_prompts(p)) for p in LESSONS}
    assert {k: v for k, v in counts.items() if k != "00" and v == 0} == {}
    assert sum(counts.values()) >= 77, counts


# -- nothing gives an answer away before its reveal -----------------------------------------------
_PROGRESS_BAR = re.compile(r"^[\w .-]*:\s+\d+%\|")  # tqdm's text: "generate:  50%|█████     | 1/2 ..."


def _text(o) -> str:
    t = o.get("text") if o.get("output_type") == "stream" else o.get("data", {}).get("text/plain", "")
    return "".join(t) if isinstance(t, list) else (t or "")


def _before_reveal_leaks(path) -> list[str]:
    """What a learner sees between a ``guess = predict(...)`` cell and the cell that reveals its
    answer that could give the answer away: any figure, Player or widget (a progress bar
    excepted), the predict cell showing more than its question, or the answer cell printing or
    displaying outside its ``with guess.reveal():`` block (that output is never hidden)."""
    cells = nbformat.read(path, as_version=4).cells
    leaks = []
    for i, c in enumerate(cells):
        m = re.search(r"^(\w+)\s*=\s*predict\(", c.source, re.M) if c.cell_type == "code" else None
        if not m:
            continue
        var = m.group(1)
        j = next((k for k in range(i + 1, len(cells)) if cells[k].cell_type == "code" and f"{var}.reveal()" in cells[k].source), None)
        if j is None:
            leaks.append(f"cell {i}: `{var}` is never revealed")
            continue
        if any(
            o.output_type != "stream" or not all(line.startswith("✎ Predict:") for line in _text(o).strip().splitlines()) for o in c.outputs
        ):
            leaks.append(f"cell {i}: the predict cell shows more than its question")
        for k in range(i + 1, j):
            for o in cells[k].get("outputs", []):
                if (
                    o.output_type in ("display_data", "execute_result")
                    and set(o.get("data", {})) - {"text/plain"}
                    and not _PROGRESS_BAR.match(_text(o))
                ):
                    leaks.append(f"cell {k}: a figure or widget between predict (cell {i}) and its reveal (cell {j}): {_text(o)[:60]!r}")
        tree = ast.parse("\n".join(line for line in cells[j].source.splitlines() if not line.lstrip().startswith(("%", "!"))))
        for st in tree.body:
            if isinstance(st, ast.With) and any(f"{var}.reveal" in ast.unparse(it.context_expr) for it in st.items):
                continue
            shown = [
                n
                for n in ast.walk(st)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("print", "display", "show", "Player")
            ]
            if shown or (st is tree.body[-1] and isinstance(st, ast.Expr) and not isinstance(st.value, ast.Call)):
                leaks.append(f"cell {j}: the answer cell shows {ast.unparse(st)[:60]!r} outside `with {var}.reveal():`")
    return leaks


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_no_answer_is_shown_before_its_reveal(path):
    """A Player, figure or printed line between a prediction and its reveal draws the answer
    before the learner has guessed (as lesson 00's Player once did)."""
    assert _before_reveal_leaks(path) == []


def test_the_leak_finder_finds_each_kind_of_leak(tmp_path):
    nb = nbformat.v4.new_notebook()
    player = nbformat.v4.new_output("display_data", data={"text/html": "<div class='kvlab-still-next'>…</div>", "text/plain": "Player"})
    bar = nbformat.v4.new_output(
        "display_data", data={"application/vnd.jupyter.widget-view+json": {}, "text/plain": "generate:  50%|#  | 1/2"}
    )
    q = nbformat.v4.new_output("stream", name="stdout", text="✎ Predict: how many?\n")
    nb.cells = [
        nbformat.v4.new_code_cell("guess = predict('how many?', kind='number')", outputs=[q]),
        nbformat.v4.new_code_cell("engine.generate(p, progress=True)", outputs=[bar]),  # fine: a progress bar
        nbformat.v4.new_code_cell("show(engine)", outputs=[player]),  # leak: a Player
        nbformat.v4.new_code_cell("with guess.reveal():\n    print(n)\nprint(n)"),  # leak: outside the block
        nbformat.v4.new_code_cell(
            "g2 = predict('which?', choices=['a', 'b'])\nprint(3)", outputs=[q, nbformat.v4.new_output("stream", name="stdout", text="3\n")]
        ),
        nbformat.v4.new_code_cell("with g2.reveal():\n    x = 1\nx"),  # leak: the bare value
        nbformat.v4.new_code_cell("g3 = predict('never revealed')"),
    ]
    path = tmp_path / "lesson.ipynb"
    nbformat.write(nb, path)
    leaks = _before_reveal_leaks(path)
    assert [leak.split(":")[0] for leak in leaks] == ["cell 2", "cell 3", "cell 4", "cell 5", "cell 6"], leaks


def test_no_lesson_is_longer_than_40_cells():
    """One sitting: a lesson longer than 40 cells (markdown and code) is split in two, each
    story whole (as 04a/04b/04c, 05a/05b, 07a/07b are)."""
    long = {p.name: n for p in LESSONS if (n := len(nbformat.read(p, as_version=4).cells)) > 40}
    assert long == {}
