"""Predict, then reveal, in a real JupyterLab. Lesson 03's first form is checked inside that
lesson's one run (``test_browser.test_lesson_runs_clean`` calls :func:`check_first_prediction`
on the learner's working copy, outputs cleared as ``make lab`` prepares it): the answer stays
hidden under a lock until a prediction is locked in; then prediction, result and ✔ appear
above the answer; the explanation below it is folded in a <details>; the locked prediction
lands in the learner's record ($KVLAB_HOME), not in the repository.
No KVLAB_PREDICT here: the mode must follow from the front end (JupyterLab sends
allow_stdin=True). Then, in a three-cell notebook: a Player inside an answer, and after a
kernel restart and a second run the locked prediction comes back locked from the record, its
answer open. Screenshots: ``test-artifacts/browser_predict_{before,after,restored}.png``.
"""

from __future__ import annotations

import json

import nbformat
import pytest

from test_browser import ALL_CELLS_RAN, ARTIFACTS, Lab, _assert_no_errors, _run_all, _wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow]

LESSON = "03_prefix_caching.ipynb"
# A Player inside a prediction's answer; the third cell re-runs after a restart.
NESTED = (
    "from IPython.display import display\nfrom kvlab import build_engine, predict, show\n"
    "engine = build_engine(num_blocks=8, block_size=4)\nengine.generate([[1, 2, 3, 4, 5]], max_tokens=2)",
    'guess = predict("How many blocks did the request hold?", kind="number")',
    'with guess.reveal():\n    print("the request held 2 blocks")\n    display(show(engine))',
)
ANSWER_SHOWN = (
    "() => [...document.querySelectorAll('.jp-OutputArea-output')]"
    ".some(o => o.offsetParent !== null && o.innerText.includes('the request held 2 blocks'))"
)


def check_first_prediction(page, lab: Lab) -> None:
    """Lesson 03's first "predict, then run" form, in the learner's working copy that
    ``test_browser.test_lesson_runs_clean`` has just run (its only run in `make test`): the
    answer is hidden until a prediction is locked; then prediction, result and ✔ appear above
    it, the explanation waits folded, the six other forms still wait, and the prediction is
    in the learner's record."""
    _assert_no_errors(page)
    forms = page.locator(".jp-OutputArea-output:has(.kvlab-live)", has_text="✎ Predict:")
    assert forms.count() == 7, forms.count()  # one form per prompt of lesson 03
    first = forms.first
    first.scroll_into_view_if_needed()
    # the answer cell ran, but what it printed is not on the page yet
    text = page.locator(".jp-Notebook").inner_text()
    assert "same key False" not in text and "The answer is ready" in text
    page.screenshot(path=str(ARTIFACTS / "browser_predict_before.png"), clip=_clip(page, first))
    first.locator("input[type='text']").fill("0")
    lock = first.locator("button", has_text="Lock in")
    _wait_until(page, "() => true", 20, "Lock in to enable", also=lambda: lock.is_enabled())
    lock.click()
    _wait_until(page, "() => true", 30, "the answer to open", also=lambda: "same key False" in page.locator(".jp-Notebook").inner_text())
    answer = page.locator(".jp-OutputArea-output", has_text="your prediction: 0 · result: 0 · ✔ right")
    assert answer.count() >= 1
    assert "Locked in: 0" in first.inner_text()
    assert sum("Lock in" in forms.nth(i).inner_text() for i in range(7)) == 6  # the six others still wait
    # the explanation waits in a closed <details>
    details = page.locator(".jp-MarkdownOutput details").first
    assert details.count() == 1 and details.get_attribute("open") is None
    page.screenshot(path=str(ARTIFACTS / "browser_predict_after.png"), clip=_clip(page, first, below=420))
    rec = json.loads((lab.home / "progress.json").read_text())
    (pred,) = rec["predictions"]
    assert pred["prediction"] == 0 and pred["result"] == 0 and pred["matched"] is True
    assert pred["lesson"] == LESSON.removesuffix(".ipynb")


@pytest.mark.timeout(420)
def test_a_locked_prediction_comes_back_from_the_record_after_a_restart(lab: Lab) -> None:
    """A Player inside a prediction's answer: hidden until the lock, then shown with the rest
    of the answer (its still's style rule must not hide the answer area around it). Then a
    kernel restart and a second run: the prediction comes back locked from the learner's
    record."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in NESTED]
    nbformat.write(nb, lab.root / "nested_player.ipynb")
    with lab.notebook("nested_player.ipynb") as page:
        _run_all(page)
        _wait_until(page, ALL_CELLS_RAN, 300, "every cell to run")
        assert not page.evaluate(ANSWER_SHOWN) and page.locator(".kvlab-player").first.is_hidden()
        form = page.locator(".jp-OutputArea-output:has(.kvlab-live)", has_text="✎ Predict:").first
        form.locator("input[type='text']").fill("2")
        lock = form.locator("button", has_text="Lock in")
        _wait_until(page, "() => true", 20, "Lock in to enable", also=lambda: lock.is_enabled())
        lock.click()
        _wait_until(
            page, ANSWER_SHOWN, 60, "the answer, Player included, to show", also=lambda: page.locator(".kvlab-player").first.is_visible()
        )
        _assert_no_errors(page)
        page.locator(".jp-NotebookPanel-toolbar [data-command='notebook:restart-run-all']").first.click()
        page.locator(".jp-Dialog .jp-mod-accept").click()
        form = page.locator(".jp-OutputArea-output:has(.kvlab-live)", has_text="✎ Predict:").first
        _wait_until(
            page,
            ANSWER_SHOWN,
            300,
            "the second run to restore the lock",
            also=lambda: "(from your record)" in form.inner_text() and page.locator(".kvlab-player").first.is_visible(),
        )
        _wait_until(page, ALL_CELLS_RAN, 300, "every cell of the second run")
        assert "Predict again" in form.inner_text() and "Lock in" not in form.inner_text()
        _assert_no_errors(page)
        page.screenshot(path=str(ARTIFACTS / "browser_predict_restored.png"), clip=_clip(page, form, below=420))


def _clip(page, locator, below: int = 260) -> dict[str, float]:
    box = locator.bounding_box()
    return {"x": 0, "y": max(0.0, box["y"] - 200), "width": 1400, "height": box["height"] + 200 + below}
