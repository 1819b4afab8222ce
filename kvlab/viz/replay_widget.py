"""The Player in JupyterLab: ONE widget that draws every view in the browser.

Why: a Player used to be a box of six plotly ``FigureWidget``s, each its own widget model
with its own start-up. On a busy machine some of them missed anywidget's start-up budget
and stayed blank, and every click went to the kernel and back before anything moved. Now
the kernel sends plain figure data, step by step, and the browser draws it with the same
renderer as the page :func:`kvlab.export_html` writes (``static/replay.js``):

* **one model** per Player, whose own code is a few kilobytes;
* **plotly.js** (~5 MB) reaches the page once, as a message the first Player asks for, and
  every later Player of the page reuses it;
* **steps travel once**: the browser asks for the step it shows and a window around it;
  the kernel answers with each figure part (trace, layout, string) it has not sent that
  view before, so stepping, the slider, Play and "jump to" inside the window need no
  kernel at all, and the status line and the pictures change together. Once the learner
  uses a recorded run's Player, the page fetches its other steps in the background, a few
  at a time, so that every jump is local;
* **never blank**: until its first picture is drawn, the widget keeps itself hidden and
  the still picture next to it (:mod:`kvlab.viz.still`) stays on screen.

The kernel side stays the Player: ``player.go_to(5)`` moves the browser, a step taken in
the browser moves ``player.step``, a request picked in the browser is ``player.select``,
and "Run step" is ``player.run_step``. The page draws a selection itself (each figure comes
with what selecting each request changes in it), so ``selected`` is synced both ways like
``step``. A live run's new step changes every figure (the timeline spans the run), so it
starts a new *version*: the browser drops what it had and asks again.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from kvlab.viz.frames import FramePacker

STATIC = Path(__file__).with_name("static")

# The anywidget side: the renderer, plotly.js fetched once per page, and the model's wiring.
_GLUE = r"""
function plotlyOnce(model) {
  const g = globalThis;
  if (g.__kvlabPlotlyLib) return Promise.resolve(g.__kvlabPlotlyLib);
  if (!g.__kvlabPlotlyLoad) {
    g.__kvlabPlotlyLoad = new Promise((resolve, reject) => {
      const onMsg = (msg) => {
        if (!msg || msg.type !== 'plotly') return;
        model.off('msg:custom', onMsg);
        try {
          const module = { exports: {} };
          (new Function('module', 'exports', msg.source))(module, module.exports);
          g.__kvlabPlotlyLib = module.exports;
          resolve(g.__kvlabPlotlyLib);
        } catch (e) { g.__kvlabPlotlyLoad = null; reject(e); }
      };
      model.on('msg:custom', onMsg);
      model.send({ type: 'plotly' });
    });
  }
  return g.__kvlabPlotlyLoad;
}

let nextView = 0;

export default {
  render({ model, el }) {
    const view = `v${++nextView}-${Math.random().toString(36).slice(2, 8)}`;
    let api = null;
    const hooks = {
      need: (steps) => model.send({ type: 'need', view, steps, version: model.get('header').version }),
      step: (s) => { model.set('step', s); model.save_changes(); },
      select: (r) => { model.set('selected', r || ''); model.save_changes(); },
      run: () => model.send({ type: 'run' }),
      drawn: () => el.classList.add('kvlab-live'),
    };
    const onMsg = (msg) => {
      if (!api || !msg || msg.type !== 'frames' || msg.view !== view) return;
      if (msg.version !== model.get('header').version) return;
      if (!api.add(msg)) model.send({ type: 'restart', view });
    };
    const onHeader = () => { if (api) api.setHeader(model.get('header'), model.get('step')); };
    const onStep = () => { if (api) api.showStep(model.get('step')); };
    const onSelected = () => { if (api) api.select(model.get('selected')); };
    model.on('msg:custom', onMsg);
    model.on('change:header', onHeader);
    model.on('change:step', onStep);
    model.on('change:selected', onSelected);
    plotlyOnce(model).then(() => {
      api = globalThis.kvlabReplay.mount(el, { ...model.get('header'), selected: model.get('selected') }, hooks);
      api.go(model.get('step'));
    }, (e) => { el.textContent = 'kvlab: the pictures could not load (' + e + '); run the cell again.'; el.classList.add('kvlab-live'); });
    return () => {
      model.off('msg:custom', onMsg);
      model.off('change:header', onHeader);
      model.off('change:step', onStep);
      model.off('change:selected', onSelected);
      if (api) api.pause();
    };
  },
};
"""


def _esm() -> str:
    return (STATIC / "replay.js").read_text(encoding="utf-8") + _GLUE


MAX_STEPS_PER_ASK = 24  # a browser asks for a window; more than this is cut (the rest is asked again)


class ReplayWidget(anywidget.AnyWidget):
    """One Player's browser side. ``header`` is what the page needs besides the figures (the
    steps, names, requests, the version); ``step`` is the step on screen, in both directions."""

    _esm = traitlets.Unicode(_esm()).tag(sync=True)
    header = traitlets.Dict().tag(sync=True)
    step = traitlets.Int(0).tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)  # "" = nothing selected; drawn by the page

    def __init__(self, owner: Any, header: dict[str, Any]) -> None:
        self._owner = owner  # the Player: renders a step's figures, takes a step, a selection
        self._packers: dict[str, FramePacker] = {}
        self._versions = itertools.count(1)
        self._ready = False  # the initial values are not a step taken in the page
        super().__init__(header=header, step=header["step"], selected=header.get("selected") or "")
        self._ready = True
        self.on_msg(self._on_msg)

    def new_version(self, **changes: Any) -> None:
        """The figures changed (a selection, a longer live run): the browser starts over."""
        self._packers.clear()
        self.header = {**self.header, **changes, "version": next(self._versions)}

    def _on_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict):
            return
        kind = content.get("type")
        if kind == "plotly":
            from plotly.offline import get_plotlyjs

            self.send({"type": "plotly", "source": get_plotlyjs()})
        elif kind == "need" and content.get("version") == self.header.get("version"):
            view = str(content.get("view"))
            packer = self._packers.setdefault(view, FramePacker(self._owner._figures_at))
            known = set(self.header["steps"])
            steps = [s for s in content.get("steps", []) if isinstance(s, int) and s in known][:MAX_STEPS_PER_ASK]
            try:
                # The step on screen first, alone: it is drawn while the rest is packed.
                for part in (steps[:1], steps[1:]):
                    if part:
                        self.send({"type": "frames", "view": view, "version": self.header["version"], **packer.pack(part)})
            finally:
                self._owner._figures_done()
        elif kind == "restart":
            self._packers.pop(str(content.get("view")), None)
            self.new_version()
        elif kind == "run":
            self._owner.run_step()

    @traitlets.observe("step")
    def _on_step(self, change: dict[str, Any]) -> None:
        if self._ready:
            self._owner._step_from_browser(int(change["new"]))

    @traitlets.observe("selected")
    def _on_selected(self, change: dict[str, Any]) -> None:
        if self._ready:
            self._owner._select_from_browser(change["new"] or None)
