// kvlab's replay renderer: one Player (its controls, its views, its status line and event
// list) drawn in the browser from plain per-step figure data. The same code draws the Player
// in JupyterLab (kvlab/viz/replay_widget.py: one anywidget per Player) and the page that
// kvlab.export_html writes (kvlab/viz/export.py). It needs a global Plotly.
//
// Data arrive in chunks (all at once for an exported page; a window around the shown step,
// asked for as the learner moves, in JupyterLab). A chunk carries the figure parts it
// introduces -- traces, layouts and strings, each stored once and numbered -- and, per step
// index, one [layout index, [trace indices]] pair per view plus the step's status and event
// list. Stepping, the slider, Play and "jump to" never wait for the kernel when the step is
// already here; the status line and the pictures change together, in one call.
//
// Selecting a request never waits either: with each view's figure (drawn with nothing
// selected) comes, per request, what selecting it changes -- a patch of a few trace and
// layout properties (where the selection mark sits, which row name is bold), or a whole other
// figure (the kernel view draws one request's reads) -- and the renderer applies it.
(function () {
  const CSS = `
.kv-replay { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; color: #111; }
.kv-replay .kv-controls { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; margin: 4px 0; font-size: 12px; }
.kv-replay .kv-controls button { font: inherit; padding: 2px 9px; border: 1px solid #999; background: #f4f4f4; border-radius: 3px; cursor: pointer; }
.kv-replay .kv-controls button:hover { background: #e8e8e8; }
.kv-replay .kv-controls button.kv-primary { background: #0072b2; color: #fff; border-color: #005a8c; }
.kv-replay .kv-controls select { font: inherit; max-width: 260px; }
.kv-replay .kv-controls input[type=range] { width: 300px; }
.kv-replay .kv-grid { display: grid; gap: 4px 8px; align-items: start; }
.kv-replay .kv-desc { font-size: 12px; color: #444; white-space: normal; }
.kv-replay .kv-status { font-size: 12px; min-height: 16px; }
.kv-replay .kv-wait { color: #777; }
`;

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // Layout keys a relayout redraws in a few milliseconds, without recomputing the traces;
  // plotly redraws a whole figure for any other change, which costs tens of milliseconds.
  const LIGHT = new Set(['title', 'shapes', 'annotations']);
  function same(a, b) { return a.length === b.length && a.every((x, i) => x === b[i]); }

  function mount(root, header, hooks) {
    hooks = hooks || {};
    if (!document.getElementById('kv-replay-css')) {
      const style = el('style', { id: 'kv-replay-css' });
      style.textContent = CSS;
      document.head.appendChild(style);
    }
    let H = header;
    let T = { traces: [], layouts: [], strings: [], marks: [] };
    let F = new Map(); // step index -> { views, status, events }
    const unpacked = new Map(), unpackedMarks = new Map();
    let sel = H.selected || null; // the selected request (drawn by this page, see patchOf)
    let k = 0, timer = null, drawnOnce = false, wanted = null, engaged = false, fillTimer = null;
    const inflight = new Set(); // step indices asked for and not here yet

    const box = el('div', { class: 'kv-replay' });
    box.style.width = H.width + 'px';
    // Fit (see fit()): as many columns of views as the output area holds, and, where even one
    // view is wider than the area, everything shown smaller (CSS zoom), never cut off.
    const designed = () => H.columns || (H.views.length > 1 ? 2 : 1);
    let scale = 1, cols = designed();
    const head = el('div');
    const title = el('b', { style: 'font-size:14px' }, H.title);
    head.appendChild(title);
    if (H.description) head.appendChild(el('div', { class: 'kv-desc' }, H.description));
    const row1 = el('div', { class: 'kv-controls' });
    const back = el('button', { title: 'previous step' }, '◀ Back');
    const play = el('button', { title: 'play the run' }, '▶ Play');
    const next = el('button', { title: 'next step' }, 'Step ▶');
    const slider = el('input', { type: 'range', min: '0', step: '1', value: '0', 'aria-label': 'step' });
    const label = el('span', { class: 'kv-step' });
    row1.append(back, play, next, slider, label);
    const row2 = el('div', { class: 'kv-controls' });
    let jump = null, pick = null, run = null;
    if (H.named && H.named.length) {
      jump = el('select', { 'aria-label': 'jump to' });
      jump.appendChild(el('option', { value: '-1' }, 'jump to …'));
      for (const [name, s] of H.named) jump.appendChild(el('option', { value: String(s) }, `${name} (step ${s})`));
      row2.appendChild(jump);
    }
    if (H.requests) {
      pick = el('select', { 'aria-label': 'request' });
      row2.appendChild(pick);
    }
    if (H.can_run) {
      run = el('button', { class: 'kv-primary', title: 'run one engine step' }, 'Run step');
      row2.appendChild(run);
    }
    const status = el('div', { class: 'kv-status' });
    const grid = el('div', { class: 'kv-grid' });
    const events = el('div', { class: 'kv-events' });
    box.append(head, row1);
    if (row2.childNodes.length) box.appendChild(row2);
    box.append(status, grid, events);
    root.appendChild(box);
    // Three drawing areas per view: the one on screen and two behind it, where the steps
    // before and after are drawn while the learner looks at this one. Step ▶, ◀ Back and Play
    // then only swap which one is shown.
    const AREAS = 3;
    let areas = [], front = [], holds = [], prep = null, shown = -1;
    if (hooks.ids) { // a page with one replay (export_html): elements a test or a reader can name
      const named = { 'kv-back': back, 'kv-play': play, 'kv-next': next, 'kv-slider': slider, 'kv-step': label, 'kv-status': status, 'kv-events': events };
      for (const id in named) named[id].id = id;
      if (jump) jump.id = 'kv-jump';
      if (pick) pick.id = 'kv-request';
    }
    function layoutViews() {
      grid.replaceChildren();
      grid.style.gridTemplateColumns = cols > 1 ? `repeat(${cols}, max-content)` : 'max-content';
      areas = H.views.map(() => {
        const cell = el('div', { class: 'kv-view' }), list = [];
        for (let j = 0; j < AREAS; j++) { const d = el('div'); if (j) d.style.display = 'none'; cell.appendChild(d); list.push(d); }
        grid.appendChild(cell);
        return list;
      });
      front = H.views.map(() => 0);
      holds = H.views.map(() => new Array(AREAS).fill(null));
      areas.forEach((_, v) => name(v));
    }

    function fillRequests() {
      if (!pick) return;
      pick.replaceChildren(el('option', { value: '' }, 'request: — none —'));
      for (const r of H.requests) pick.appendChild(el('option', { value: r }, 'request: ' + r));
      pick.value = sel || '';
    }

    function unpack(o) {
      if (Array.isArray(o)) return o.map(unpack);
      if (o && typeof o === 'object') {
        if (o.__s) return o.__s.map(x => Array.isArray(x) ? x.map(i => T.strings[i]) : T.strings[x]);
        const r = {};
        for (const key in o) r[key] = unpack(o[key]);
        return r;
      }
      return o;
    }
    function trace(t) {
      if (!unpacked.has(t)) unpacked.set(t, unpack(T.traces[t]));
      return unpacked.get(t);
    }
    function patchOf(mi) { // what selecting `sel` changes in a view's figure (null: nothing)
      if (mi === undefined || mi < 0 || !sel) return null;
      if (!unpackedMarks.has(mi)) unpackedMarks.set(mi, unpack(T.marks[mi]));
      return unpackedMarks.get(mi)[sel] || null;
    }
    function withPaths(layout, paths) { // layout with "a.b.c" properties set, copied on the way
      const out = { ...layout };
      for (const path in paths) {
        const parts = path.split('.');
        let o = out;
        for (let j = 0; j < parts.length - 1; j++) { o[parts[j]] = { ...(o[parts[j]] || {}) }; o = o[parts[j]]; }
        o[parts[parts.length - 1]] = paths[path];
      }
      return out;
    }

    function ask(i) {
      // The step to show, then a window ahead of it (and a little behind), in one request.
      if (!hooks.need) return;
      const n = H.steps.length, out = [];
      for (let j = i - 2; j <= i + 8; j++) if (j >= 0 && j < n && !F.has(j) && !inflight.has(j)) out.push(j);
      out.sort((a, b) => Math.abs(a - i) - Math.abs(b - i) || b - a);
      for (const j of out) inflight.add(j);
      if (out.length) hooks.need(out.map(j => H.steps[j]));
    }

    const FILL = 8; // steps per background request
    function fillLater() {
      // A recorded run (H.fill) that the learner has started to use: the rest of its steps
      // come in the background, a few at a time and nearest first, whenever nothing else is
      // asked for -- after that, any jump is drawn without the kernel. A run that is never
      // touched costs the kernel nothing more, and a live run (whose steps all change when it
      // grows) is asked for around the step on screen only.
      if (!H.fill || !engaged || !hooks.need || fillTimer || inflight.size) return;
      fillTimer = setTimeout(() => {
        fillTimer = null;
        if (inflight.size) return;
        const out = [];
        for (let d = 0; out.length < FILL && d < H.steps.length; d++) {
          for (const j of d ? [k + d, k - d] : [k]) {
            if (j >= 0 && j < H.steps.length && !F.has(j) && out.length < FILL) out.push(j);
          }
        }
        if (!out.length) return;
        for (const j of out) inflight.add(j);
        hooks.need(out.map(j => H.steps[j]));
      }, 250);
    }

    function name(v) { // the id a reader can name stays on the drawing area on screen
      if (!hooks.ids) return;
      areas[v].forEach((d, j) => { if (j === front[v]) d.id = 'kv-view-' + v; else d.removeAttribute('id'); });
    }

    function render(div, li, ts, mi) {
      const P = globalThis.__kvlabPlotlyLib || globalThis.Plotly, was = div.__kv;
      let p = patchOf(mi);
      if (p && p.figure) { [li, ts] = p.figure; p = null; }
      const pk = p ? `${mi}:${sel}` : '';
      const layout = p && p.layout ? withPaths(T.layouts[li], p.layout) : T.layouts[li];
      div.__kv = { T, li, ts, pk, layout };
      if (was && was.T === T && same(was.ts, ts) && was.pk === pk) {
        if (was.li === li) return; // this view did not change at this step
        const upd = {};
        for (const key of new Set([...Object.keys(was.layout), ...Object.keys(layout)])) {
          if (JSON.stringify(was.layout[key]) !== JSON.stringify(layout[key])) upd[key] = layout[key] === undefined ? null : layout[key];
        }
        if (Object.keys(upd).every(key => LIGHT.has(key))) { P.relayout(div, upd); return; }
      }
      let data = ts.map(trace);
      if (p && p.traces) {
        data = data.slice();
        for (const i in p.traces) data[i] = { ...data[i], ...p.traces[i] };
      }
      P.react(div, data, { ...layout }, H.config);
    }

    function prepare(targets) {
      // Draw the neighbouring steps behind the views on screen (laid out but invisible, then
      // taken out of the layout); a swap shows one if the learner goes there next.
      prep = null;
      for (const i of targets) {
        if (!F.has(i)) continue;
        F.get(i).views.forEach(([li, ts, mi], v) => {
          if (holds[v].includes(i)) return;
          const j = holds[v].findIndex((h, jj) => jj !== front[v] && !targets.includes(h));
          if (j < 0) return;
          const d = areas[v][j];
          Object.assign(d.style, { display: '', visibility: 'hidden', position: 'absolute', left: '0', top: '0' });
          render(d, li, ts, mi);
          Object.assign(d.style, { display: 'none', visibility: '', position: '', left: '', top: '' });
          holds[v][j] = i;
          d.dataset.holds = H.steps[i]; // which step this area holds (for a reader, or a test)
        });
      }
    }

    function schedulePrepare() {
      // After the browser has painted this step: the step after it (Step ▶, Play), then the one before.
      if (prep) clearTimeout(prep);
      const targets = [shown + 1, shown - 1].filter(i => i >= 0 && i < H.steps.length && F.has(i));
      if (!targets.length) return;
      requestAnimationFrame(() => { if (prep) clearTimeout(prep); prep = setTimeout(() => prepare(targets), 0); });
    }

    function draw(i) {
      const f = F.get(i);
      f.views.forEach(([li, ts, mi], v) => {
        const j = holds[v].findIndex((h, jj) => h === i && jj !== front[v]);
        if (j >= 0) { // drawn already, behind: swap
          areas[v][j].style.display = '';
          areas[v][front[v]].style.display = 'none';
          front[v] = j;
          name(v);
        } else {
          render(areas[v][front[v]], li, ts, mi);
          holds[v][front[v]] = i;
          areas[v][front[v]].dataset.holds = H.steps[i];
        }
      });
      shown = i;
      schedulePrepare();
      status.innerHTML = f.status;
      events.innerHTML = f.events;
      label.textContent = `${H.unit || 'step'} ${H.steps[i]} of ${H.steps[H.steps.length - 1]}`;
      box.dataset.step = H.steps[i];
      if (hooks.ids) document.body.dataset.step = H.steps[i];
      if (!drawnOnce) { drawnOnce = true; if (hooks.drawn) hooks.drawn(); }
    }

    function show(i, fromUser) {
      k = Math.max(0, Math.min(H.steps.length - 1, i));
      slider.value = k;
      if (F.has(k)) {
        wanted = null;
        draw(k);
        ask(k);
      } else {
        wanted = k;
        status.innerHTML = `<span class="kv-wait">step ${H.steps[k]}: drawing…</span>`;
        ask(k);
      }
      if (fromUser && hooks.step) hooks.step(H.steps[k]);
      if (fromUser) { engaged = true; fillLater(); }
    }

    function pause() { if (timer) { clearInterval(timer); timer = null; } play.textContent = '▶ Play'; }
    function playOrPause() {
      if (timer) { pause(); return; }
      if (k >= H.steps.length - 1) show(0, true);
      play.textContent = '❚❚ Pause';
      timer = setInterval(() => {
        if (k >= H.steps.length - 1) pause();
        else if (F.has(k + 1)) show(k + 1, true);
        else ask(k + 1); // wait for it: a tick is skipped, not a step
      }, H.interval || 900);
    }
    back.onclick = () => { pause(); show(k - 1, true); };
    next.onclick = () => { pause(); show(k + 1, true); };
    play.onclick = playOrPause;
    slider.oninput = () => { pause(); show(parseInt(slider.value, 10), true); };
    if (jump) jump.onchange = () => {
      const s = parseInt(jump.value, 10);
      if (s >= 0) { pause(); show(H.steps.indexOf(s), true); }
      jump.value = '-1';
    };
    function fit() {
      // The room is the container's width (a notebook's output area, a page's body). The views
      // keep their designed size: the designed columns when they fit, a third column in a wide
      // window, one column in a narrow one; only a view wider than the whole area is zoomed out.
      const cs = getComputedStyle(root);
      const avail = Math.floor(root.clientWidth - (parseFloat(cs.paddingLeft) || 0) - (parseFloat(cs.paddingRight) || 0));
      const want = designed(), gap = 8;
      const viewW = (H.width - gap * (want - 1)) / want;
      if (!avail || !viewW) return;
      let c = want;
      while (c > 1 && c * viewW + gap * (c - 1) > avail) c--;
      while (c < Math.min(3, H.views.length) && (c + 1) * viewW + gap * c <= avail) c++;
      const s = Math.min(1, avail / (c * viewW + gap * (c - 1)));
      if (c === cols && Math.abs(s - scale) < 0.005) return;
      cols = c; scale = s;
      grid.style.gridTemplateColumns = cols > 1 ? `repeat(${cols}, max-content)` : 'max-content';
      grid.style.zoom = scale === 1 ? '' : String(scale);
      box.style.width = Math.floor(Math.max(cols * viewW + gap * (cols - 1), Math.min(avail, H.width)) * scale) + 'px';
    }
    if (globalThis.ResizeObserver) new ResizeObserver(() => requestAnimationFrame(fit)).observe(root);

    function select(r) {
      // Draw the step on screen with the new selection; the neighbours drawn behind it are redrawn.
      r = r || null;
      if (pick) pick.value = r || '';
      if (r === sel) return;
      sel = r;
      holds = H.views.map(() => new Array(AREAS).fill(null));
      if (shown >= 0 && F.has(shown)) draw(shown);
    }
    if (pick) pick.onchange = () => { engaged = true; select(pick.value); if (hooks.select) hooks.select(sel); fillLater(); };
    if (run) run.onclick = () => { pause(); if (hooks.run) hooks.run(); };

    function setHeader(h, step) {
      // A new header is a new version: what was here is dropped and asked for again.
      H = h;
      T = { traces: [], layouts: [], strings: [], marks: [] }; F = new Map(); unpacked.clear(); unpackedMarks.clear(); inflight.clear();
      if (fillTimer) { clearTimeout(fillTimer); fillTimer = null; }
      slider.max = H.steps.length - 1;
      fillRequests();
      if (areas.length !== H.views.length) layoutViews();
      holds = H.views.map(() => new Array(AREAS).fill(null));
      const at = H.steps.indexOf(step);
      show(at >= 0 ? at : H.steps.length - 1, false);
    }

    function add(chunk) {
      // Tables grow in order: a chunk's entries start where the last one's ended.
      if (chunk.t0 !== T.traces.length || chunk.l0 !== T.layouts.length || chunk.s0 !== T.strings.length || chunk.m0 !== T.marks.length) return false;
      T.traces.push(...chunk.traces);
      T.layouts.push(...chunk.layouts);
      T.strings.push(...chunk.strings);
      T.marks.push(...chunk.marks);
      chunk.steps.forEach((s, j) => {
        const i = H.steps.indexOf(s);
        if (i >= 0) { F.set(i, { views: chunk.frames[j], status: chunk.status[j], events: chunk.events[j] }); inflight.delete(i); }
      });
      box.dataset.have = F.size; // how many steps the page holds (for a reader, or a test)
      if (wanted !== null && F.has(wanted)) { const w = wanted; wanted = null; draw(w); ask(w); }
      else if (drawnOnce) schedulePrepare();
      fillLater();
      return true;
    }

    layoutViews();
    fillRequests();
    slider.max = H.steps.length - 1;
    fit();
    return {
      add,
      setHeader,
      showStep(s) { const i = H.steps.indexOf(s); if (i >= 0 && i !== k) { pause(); show(i, false); } },
      go(s) { const i = H.steps.indexOf(s); show(i >= 0 ? i : 0, false); },
      select,
      get selected() { return sel; },
      get scale() { return scale; },
      get columns() { return cols; },
      get index() { return k; },
      pause,
      root: box,
    };
  }

  globalThis.kvlabReplay = { mount };
})();
