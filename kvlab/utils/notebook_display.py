"""A widget with a still beside it: what a saved or never-run lesson shows instead of the
widget (Players, quizzes and the learner's predictions use it).

A widget needs a running kernel. A lesson opened without one -- never run (untrusted, so no
widgets) or reopened after saving (the widget's model is gone) -- would show a raw
``VBox(children=…`` line or "Error displaying widget: model not found". So each widget is
displayed after a still (a mime bundle that needs no kernel: plotly JSON, HTML, text) and a
style rule that shows exactly one of the two. Here, not in the views, because the learner's
predictions (``kvlab.learner``) need it and may not import a view.
"""

from __future__ import annotations

from typing import Any

# The widest a picture may be: JupyterLab's output area is 848 px wide in a 1280 px window
# with the file browser open, and anything wider is cut off there. Every figure of the
# course and the Player (its views two per row) fit in this.
OUTPUT_WIDTH = 840

# The still sits in the output right before the widget's. This rule hides the still once
# the widget is drawn (it carries the LIVE class), and hides the widget's output while it is
# loading or when it cannot be drawn (its model is gone), so a saved lesson shows the
# picture instead of an error. (CSS :has() -- Chromium 105+, Firefox 121+, Safari 15.4+.)
STILL_MARK = "kvlab-still-next"
LIVE = "kvlab-live"
# Each selector names the output's *own* content (``> .jp-OutputArea-output > …``): a widget
# shown this way inside another widget's output area (a Player inside a prediction's hidden
# answer) puts its mark in a nested output area, and a bare ``:has(.mark)`` would then match
# -- and hide -- the outer output holding the whole answer.
_OWN = f"> .jp-OutputArea-output > .{STILL_MARK}"
STILL_STYLE = (
    "<style>"
    f".jp-OutputArea-child:has({_OWN}) {{display:none}}"
    f".jp-OutputArea-child:has({_OWN}) + .jp-OutputArea-child:has(+ .jp-OutputArea-child .{LIVE}) {{display:none}}"
    f".jp-OutputArea-child:has({_OWN}) + .jp-OutputArea-child + .jp-OutputArea-child:not(:has(.{LIVE})) "
    "{height:0;overflow:hidden;visibility:hidden}"
    f"</style><div class='{STILL_MARK}'></div>"
)


def display_with_still(widget: Any, still: dict[str, Any], *, mark_live: bool = True) -> Any:
    """Display ``widget`` as three outputs -- the style rule, ``still`` (a mime bundle that
    needs no kernel: plotly JSON, HTML, text) and the widget -- so that a lesson saved or
    never run shows the still where the widget would be. ``widget`` gets the LIVE class.
    Returns the still's display handle (``handle.update(bundle, raw=True)`` redraws it).

    ``mark_live=False``: the widget's own page code adds the LIVE class when it has drawn
    (the Player's renderer does, after its first picture), so the still stays until then.
    The waiting widget is laid out but invisible (not ``display:none``), so it can draw."""
    from IPython.display import display

    if mark_live:
        widget.add_class(LIVE)
    display({"text/html": STILL_STYLE, "text/plain": ""}, raw=True)
    handle = display(still, raw=True, display_id=True)
    bundle = widget._repr_mimebundle_()
    if isinstance(bundle, tuple):  # anywidget: (data, metadata)
        bundle = bundle[0]
    if isinstance(bundle, dict):
        bundle["text/plain"] = ""  # never the VBox(children=...) repr: the still stands in
    display(bundle, raw=True)
    return handle
