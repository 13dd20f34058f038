// Cache panel: slots, tiers, radix tree, LRU list, history chart; polls GET cache.
import { getJSON } from './api.js';

const SVG_NS = 'http://www.w3.org/2000/svg';
const nf = new Intl.NumberFormat('en-US');
const num = (v) => (typeof v === 'number' && Number.isFinite(v) ? v : 0);
const n = (v) => nf.format(num(v));
const pct = (part, whole) => (whole > 0 ? Math.round((100 * part) / whole) : 0);
const arr = (v) => (Array.isArray(v) ? v : []);

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k === 'class') el.className = v;
    else if (k === 'text') el.textContent = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children) if (c != null && c !== false) el.append(c);
  return el;
}

function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null) continue;
    if (k === 'text') el.textContent = v;
    else el.setAttribute(k, String(v));
  }
  for (const c of children) if (c != null) el.append(c);
  return el;
}

export function fmtBytes(b) {
  b = num(b);
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) {
    b /= 1024;
    i++;
  }
  return (i === 0 ? String(Math.round(b)) : b.toFixed(b >= 100 ? 0 : 1)) + ' ' + units[i];
}

// Show control characters visibly and cut to `max` characters (from the end when fromEnd).
function preview(text, max = 40, fromEnd = false) {
  const t = String(text || '').replace(/\r?\n/g, '↵').replace(/\s/g, ' ');
  if (t.length <= max) return t;
  return fromEnd ? '…' + t.slice(t.length - max) : t.slice(0, max) + '…';
}

function bar(fraction, label) {
  const fill = h('span', { class: 'fill' });
  fill.style.width = Math.max(0, Math.min(100, fraction * 100)).toFixed(1) + '%';
  return h('span', { class: 'meter', 'aria-hidden': 'true', title: label }, fill);
}

function dl(rows) {
  const list = h('dl');
  for (const [k, v] of rows) list.append(h('div', null, h('dt', { text: k }), h('dd', null, v)));
  return list;
}

// ---------------------------------------------------------------- sections

function renderTotals(el, totals) {
  const computed = num(totals.prompt_tokens);
  const reused = num(totals.cached_tokens);
  const requests = num(totals.requests);
  el.dataset.promptTokens = String(computed);
  el.dataset.cachedTokens = String(reused);
  el.dataset.requests = String(requests);
  el.textContent = 'Prompt tokens reused: ' + n(reused) + ' of ' + n(reused + computed) +
    ' (' + pct(reused, reused + computed) + '%) over ' + n(requests) + (requests === 1 ? ' request' : ' requests');
}

const STATE_LABEL = { idle: 'idle', processing_prompt: 'reading prompt', generating: 'generating' };

function renderSlots(table, slots) {
  const body = h('tbody');
  for (const slot of slots) {
    const held = num(slot.n_tokens);
    const ctx = num(slot.n_ctx);
    const state = String(slot.state || '');
    body.append(h('tr', { 'data-slot': slot.id, 'data-state': state },
      h('th', { scope: 'row', text: String(slot.id) }),
      h('td', null, h('span', { class: 'state state-' + state.replace(/[^a-z_]/g, ''), text: STATE_LABEL[state] || state })),
      h('td', null, n(held) + ' / ' + n(ctx) + ' ', bar(ctx ? held / ctx : 0, pct(held, ctx) + '% of context')),
      h('td', { text: n(slot.shared_cells) }),
      h('td', { text: n(slot.n_prompt_tokens_cache) + ' / ' + n(slot.n_prompt_tokens_processed) }),
      h('td', { text: slot.salted ? 'yes' : 'no' })));
  }
  if (!slots.length) body.append(h('tr', null, h('td', { colspan: 6, class: 'muted', text: 'no slots' })));
  const old = table.tBodies[0];
  if (old) old.replaceWith(body);
  else table.append(body);
}

function tier(el, title, fraction, rows) {
  const head = [h('h4', { text: title })];
  if (fraction != null) {
    const m = bar(fraction, Math.round(fraction * 100) + '% full');
    m.classList.add('wide');
    head.push(m);
  }
  el.replaceChildren(...head, dl(rows));
}

function renderTiers(data) {
  const dev = data.device || {};
  const cells = num(dev.n_cells);
  const used = num(dev.used_cells);
  tier(document.getElementById('tier-device'), 'Device KV', cells ? used / cells : 0, [
    ['Cells', n(used) + ' / ' + n(cells) + ' (' + pct(used, cells) + '%)'],
    ['Shared cells', n(dev.shared_cells)],
    ['Bytes', fmtBytes(used * num(dev.bytes_per_cell))],
  ]);

  const ram = data.ram || {};
  const ramEl = document.getElementById('tier-ram');
  const backend = String(data.backend || 'none');
  if (backend === 'none') {
    tier(ramEl, 'Host RAM', null, [['Backend', 'none (no host cache)']]);
  } else {
    const limit = num(ram.limit_bytes);
    const unique = num(ram.unique_tokens);
    const logical = num(ram.logical_tokens);
    tier(ramEl, 'Host RAM (' + backend + ')', limit ? num(ram.bytes) / limit : null, [
      ['Bytes', fmtBytes(ram.bytes) + ' of ' + (limit ? fmtBytes(limit) : 'no limit')],
      ['Prompts', n(ram.prompts)],
      ['Nodes', n(ram.nodes)],
      ['Unique / logical tokens', n(unique) + ' / ' + n(logical)],
      ['Sharing factor', unique > 0 ? '×' + (logical / unique).toFixed(2) : '–'],
      ['Hit tokens', n(ram.hit_tokens)],
      ['Evictions', n(ram.evictions)],
    ]);
  }

  const diskEl = document.getElementById('tier-disk');
  const disk = data.disk;
  diskEl.hidden = !disk;
  if (disk) {
    const limit = num(disk.limit_bytes);
    tier(diskEl, 'Disk', limit ? num(disk.bytes) / limit : null, [
      ['Bytes', fmtBytes(disk.bytes) + ' of ' + (limit ? fmtBytes(limit) : 'no limit')],
      ['Tokens', n(disk.tokens)],
      ['Files', n(disk.files)],
      ['Hits / misses', n(disk.hits) + ' / ' + n(disk.misses)],
      ['Writes', n(disk.writes)],
    ]);
  } else {
    diskEl.replaceChildren();
  }
}

function nodeItem(node, scale) {
  const li = h('li');
  const text = String(node.text || '');
  li.append(h('div', { class: 'node' },
    bar(scale ? num(node.subtree_tokens) / scale : 0, n(node.subtree_tokens) + ' tokens in subtree'),
    h('span', { class: 'edge', title: 'tokens on this edge', text: '+' + n(node.tokens) }),
    h('span', { class: 'meta', text: '@' + n(node.depth) + ' · ' + n(node.subtree_tokens) + ' sub · ' +
      n(node.leaves) + (num(node.leaves) === 1 ? ' leaf' : ' leaves') }),
    text ? h('q', { class: 'preview', title: text.slice(0, 500), text: preview(text) }) : null));
  const kids = arr(node.children);
  if (kids.length || num(node.more) > 0) {
    const ul = h('ul');
    for (const k of kids) ul.append(nodeItem(k, scale));
    if (num(node.more) > 0) ul.append(h('li', { class: 'more', text: '+' + n(node.more) + ' more' }));
    li.append(ul);
  }
  return li;
}

function renderTree(el, data) {
  const backend = String(data.backend || 'none');
  const out = [];
  if (backend === 'legacy') {
    const entries = arr(data.entries);
    out.push(h('p', { class: 'muted', text: 'Legacy prompt cache: ' + n(entries.length) +
      (entries.length === 1 ? ' entry' : ' entries') + ', oldest first.' }));
    if (entries.length) {
      const ol = h('ol', { class: 'entries' });
      for (const e of entries) {
        ol.append(h('li', null, n(e.tokens) + ' tokens · ' + fmtBytes(e.bytes) + ' ',
          e.text ? h('q', { class: 'preview', title: String(e.text).slice(-500), text: preview(e.text, 40, true) }) : null));
      }
      out.push(ol);
    } else {
      out.push(h('p', { class: 'empty', text: 'empty' }));
    }
  } else if (!data.tree) {
    out.push(h('p', { class: 'empty', text: backend === 'none' ? 'No host RAM cache.' : 'empty' }));
  } else {
    const roots = arr(data.tree.roots);
    if (!roots.some((r) => arr(r.children).length || num(r.more) > 0)) {
      out.push(h('p', { class: 'empty', text: 'empty' }));
    }
    for (const root of roots) {
      if (!arr(root.children).length && !num(root.more) && roots.length > 1) continue;
      const label = root.namespace ? String(root.namespace) : 'shared';
      const scale = num(root.subtree_tokens);
      const ul = h('ul', { class: 'tree' });
      for (const k of arr(root.children)) ul.append(nodeItem(k, scale));
      if (num(root.more) > 0) ul.append(h('li', { class: 'more', text: '+' + n(root.more) + ' more' }));
      out.push(h('div', { class: 'tree-root', 'data-namespace': root.namespace || '' },
        h('div', { class: 'root-head' },
          h('strong', { text: label }),
          ' ' + n(root.subtree_tokens) + ' tokens · ' + n(root.leaves) +
          (num(root.leaves) === 1 ? ' leaf' : ' leaves') + ' · ' + fmtBytes(root.bytes)),
        ul));
    }
  }
  if (data.text_shown === false && backend !== 'none') {
    out.push(h('p', { class: 'muted', text: 'Prompt text is hidden, as llama-server\'s /slots hides it: ' +
      'start the server with LLAMA_SERVER_SLOTS_DEBUG=1 to show it.' }));
  }
  el.replaceChildren(...out);
}

function renderLru(ol, lru) {
  ol.replaceChildren(...lru.map((e) => h('li', null,
    h('span', { class: 'meta', text: '@' + n(e.depth) + ' · +' + n(e.tokens) + ' tok · ' + fmtBytes(e.bytes) + ' ' }),
    e.text ? h('q', { class: 'preview', title: String(e.text).slice(-500), text: preview(e.text, 48, true) }) : null)));
  const empty = document.getElementById('lru-empty');
  if (empty) empty.hidden = lru.length > 0;
}

// ---------------------------------------------------------------- chart

const CHART = { h: 240, left: 52, right: 46, top: 30, bottom: 22 };

// viewBox width follows the drawn width so labels keep a readable size.
function chartWidth(svg) {
  const px = svg.getBoundingClientRect().width;
  return Math.round(Math.max(320, Math.min(800, px || 640)));
}

function niceMax(v) {
  if (v <= 0) return 10;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function renderChart(svg, history, w) {
  const { h: hh, left, right, top, bottom } = CHART;
  const pw = w - left - right;
  const ph = hh - top - bottom;
  svg.setAttribute('viewBox', '0 0 ' + w + ' ' + hh);
  svg.setAttribute('width', String(w));  // the intrinsic ratio comes from width/height
  svg.setAttribute('height', String(hh));
  const g = [];
  let sumReused = 0;
  let sumComputed = 0;
  for (const e of history) {
    sumReused += num(e.cache_n);
    sumComputed += num(e.prompt_n);
  }
  const rate = pct(sumReused, sumReused + sumComputed);
  svg.setAttribute('aria-label', history.length
    ? 'Last ' + history.length + (history.length === 1 ? ' prompt: ' : ' prompts: ') + rate +
      '% of prompt tokens reused (' + n(sumReused) + ' reused, ' + n(sumComputed) + ' computed).'
    : 'No prompts yet.');

  // legend
  const lx = left;
  g.push(s('rect', { x: lx, y: 8, width: 12, height: 12, class: 'c-reused' }),
    s('text', { x: lx + 16, y: 18, class: 'c-label', text: 'reused' }),
    s('rect', { x: lx + 76, y: 8, width: 12, height: 12, class: 'c-computed' }),
    s('text', { x: lx + 92, y: 18, class: 'c-label', text: 'computed' }),
    s('line', { x1: lx + 168, y1: 14, x2: lx + 188, y2: 14, class: 'c-line' }),
    s('text', { x: lx + 192, y: 18, class: 'c-label', text: w >= 520 ? 'cumulative hit rate (right axis)' : 'hit rate' }));

  const maxTotal = niceMax(Math.max(0, ...history.map((e) => num(e.cache_n) + num(e.prompt_n))));
  const y = (v) => top + ph - (ph * v) / maxTotal;
  const yr = (r) => top + ph - ph * r;
  // axes and grid
  for (const f of [0, 0.5, 1]) {
    const yy = top + ph - ph * f;
    g.push(s('line', { x1: left, y1: yy, x2: left + pw, y2: yy, class: f ? 'c-grid' : 'c-axis' }),
      s('text', { x: left - 6, y: yy + 4, 'text-anchor': 'end', class: 'c-label', text: nf.format(maxTotal * f) }),
      s('text', { x: left + pw + 6, y: yy + 4, class: 'c-label', text: Math.round(f * 100) + '%' }));
  }
  g.push(s('text', { x: left, y: hh - 6, class: 'c-label', text: 'tokens per prompt, oldest → newest' }));

  if (!history.length) {
    g.push(s('text', { x: left + pw / 2, y: top + ph / 2, 'text-anchor': 'middle', class: 'c-label', text: 'No prompts yet' }));
  } else {
    const slot = pw / Math.max(history.length, 24);
    const bw = Math.max(1, slot * 0.78);
    let cumR = 0;
    let cumC = 0;
    const pts = [];
    history.forEach((e, i) => {
      const r = num(e.cache_n);
      const c = num(e.prompt_n);
      const x = left + i * slot + (slot - bw) / 2;
      const bars = s('g', null, s('title', { text: 'Prompt ' + (i + 1) + ': ' + n(r) + ' reused, ' + n(c) + ' computed' }));
      if (r > 0) bars.append(s('rect', { x: x.toFixed(2), y: y(r).toFixed(2), width: bw.toFixed(2), height: (y(0) - y(r)).toFixed(2), class: 'c-reused' }));
      if (c > 0) bars.append(s('rect', { x: x.toFixed(2), y: y(r + c).toFixed(2), width: bw.toFixed(2), height: (y(r) - y(r + c)).toFixed(2), class: 'c-computed' }));
      g.push(bars);
      cumR += r;
      cumC += c;
      const rr = cumR + cumC > 0 ? cumR / (cumR + cumC) : 0;
      pts.push((x + bw / 2).toFixed(2) + ',' + yr(rr).toFixed(2));
    });
    g.push(s('polyline', { points: pts.join(' '), class: 'c-line' }));
    const last = pts[pts.length - 1].split(',');
    g.push(s('circle', { cx: last[0], cy: last[1], r: 3, class: 'c-dot' }));
  }
  svg.replaceChildren(...g);
}

// ---------------------------------------------------------------- panel + polling

const PAUSED = 'Paused: the server needs an API key (use the “API key” button).';

export function createCachePanel({ interval = 1000 } = {}) {
  const statusEl = document.getElementById('cache-status');
  const last = {};
  let inFlight = false;
  let again = false;
  let paused = false;
  let timer = null;
  const chartEl = document.getElementById('history-chart');
  renderChart(chartEl, [], chartWidth(chartEl));

  function changed(key, value) {
    const json = JSON.stringify(value);
    if (last[key] === json) return false;
    last[key] = json;
    return true;
  }

  function render(data) {
    if (!data || typeof data !== 'object') throw new Error('unexpected cache answer');
    if (changed('totals', data.totals)) renderTotals(document.getElementById('totals'), data.totals || {});
    if (changed('slots', data.slots)) renderSlots(document.getElementById('slots'), arr(data.slots));
    if (changed('tiers', [data.backend, data.device, data.ram, data.disk])) renderTiers(data);
    if (changed('tree', [data.backend, data.text_shown, data.tree && data.tree.roots, data.entries])) renderTree(document.getElementById('tree'), data);
    if (changed('lru', data.tree && data.tree.lru)) renderLru(document.getElementById('lru'), arr(data.tree && data.tree.lru));
    const chart = document.getElementById('history-chart');
    const width = chartWidth(chart);
    if (changed('history', [data.history, width])) renderChart(chart, arr(data.history), width);
  }

  function status(text, isError) {
    statusEl.textContent = text;
    statusEl.classList.toggle('error', !!isError);
  }

  async function poll(force) {
    if (paused) return;
    if (inFlight) {
      if (force) again = true;
      return;
    }
    if (!force && document.visibilityState !== 'visible') return;
    inFlight = true;
    try {
      const data = await getJSON('cache');
      render(data);
      status('Updated ' + new Date().toLocaleTimeString() + ' · backend: ' + String(data.backend || 'none'), false);
    } catch (err) {
      if (err && err.status === 401) {
        paused = true;
        status(PAUSED, true);
      } else if (err && err.status === 501) {  // --no-slots: the view is off, for good
        paused = true;
        clearInterval(timer);
        status('The cache view is off on this server (started with --no-slots).', false);
      } else {
        status('Error: ' + ((err && err.message) || String(err)) + ' (retrying)', true);
      }
    } finally {
      inFlight = false;
      if (again) {
        again = false;
        poll(true);
      }
    }
  }

  return {
    start() {
      if (timer === null) timer = setInterval(() => poll(false), interval);
      document.addEventListener('visibilitychange', () => {
        if (document.visibilityState === 'visible') poll(false);
      });
      poll(false);
    },
    refresh: () => poll(true),
    pause() {
      paused = true;
      status(PAUSED, true);
    },
    resume() {
      paused = false;
      poll(true);
    },
    render,
  };
}
