// Chat panel: settings, conversation, streaming answers.
import { streamChat } from './api.js';

const SETTINGS_STORAGE = 'radixserve.settings';
const CHAT_STORAGE = 'radixserve.conversation';

// Page defaults; the server's (sampling flags, then ui_settings) override them, and values the
// user typed override both.
const PAGE_DEFAULTS = {
  system: '', temperature: '0.8', top_k: '40', top_p: '0.95', min_p: '0.05', max_tokens: '256', seed: '',
};
// llama.cpp web UI key -> our field id
const UI_KEYS = {
  systemMessage: 'system', temperature: 'temperature', top_k: 'top_k', top_p: 'top_p',
  min_p: 'min_p', max_tokens: 'max_tokens', seed: 'seed',
};
const NUMERIC = ['temperature', 'top_k', 'top_p', 'min_p', 'max_tokens'];

function load(key, fallback, check) {
  try {
    const raw = localStorage.getItem(key);
    if (raw == null) return fallback;
    const value = JSON.parse(raw);
    return check(value) ? value : fallback;
  } catch {
    return fallback;
  }
}

function store(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    // storage full or disabled: the page keeps working without persistence
  }
}

const fmt = new Intl.NumberFormat('en-US');
const isObj = (v) => v !== null && typeof v === 'object' && !Array.isArray(v);

export function createChat({ onFinished = () => {} } = {}) {
  const $ = (id) => document.getElementById(id);
  const form = $('chat-form');
  const prompt = $('prompt');
  const sendBtn = $('send');
  const stopBtn = $('stop');
  const list = $('messages');
  const fields = {};
  for (const id of Object.keys(PAGE_DEFAULTS)) fields[id] = $(id);

  let serverDefaults = {};
  let userSettings = load(SETTINGS_STORAGE, {}, isObj);
  let turns = load(CHAT_STORAGE, [], Array.isArray).filter(
    (t) => isObj(t) && (t.role === 'user' || t.role === 'assistant') && typeof t.content === 'string');
  for (const t of turns) {
    if (t.role === 'assistant' && !['done', 'stopped', 'error'].includes(t.state)) t.state = 'stopped';
  }
  let controller = null;

  // ---- settings ----
  function applySettings() {
    for (const [id, el] of Object.entries(fields)) {
      if (!el) continue;
      let v = PAGE_DEFAULTS[id];
      if (id in serverDefaults) v = serverDefaults[id];
      if (typeof userSettings[id] === 'string') v = userSettings[id];
      if (el.value !== v) el.value = v;
    }
  }

  // The server's defaults: its sampling flags (props.default_generation_settings.params, so
  // --temp, --top-k, -n... hold for the page too), then the admin's --ui-config on top.
  function applyServerSettings(ui, params) {
    serverDefaults = {};
    const put = (id, v) => {
      if (id === 'system') {
        if (typeof v === 'string') serverDefaults.system = v;
      } else if (typeof v === 'number' && Number.isFinite(v)) {
        serverDefaults[id] = String(v);
      } else if (typeof v === 'string' && v.trim() !== '' && Number.isFinite(Number(v))) {
        serverDefaults[id] = v.trim();
      }
    };
    if (isObj(params)) {
      for (const id of ['temperature', 'top_k', 'top_p', 'min_p']) put(id, params[id]);
      put('max_tokens', params.n_predict);
      // llama.cpp's "random" seed (LLAMA_DEFAULT_SEED) stays an empty field
      if (params.seed !== 4294967295 && params.seed !== -1) put('seed', params.seed);
    }
    if (isObj(ui)) {
      for (const [key, id] of Object.entries(UI_KEYS)) put(id, ui[key]);
    }
    applySettings();
  }

  for (const [id, el] of Object.entries(fields)) {
    if (!el) continue;
    el.addEventListener('input', () => {
      userSettings[id] = el.value;
      store(SETTINGS_STORAGE, userSettings);
    });
  }
  const resetBtn = $('reset-settings');
  if (resetBtn) {
    resetBtn.addEventListener('click', () => {
      userSettings = {};
      store(SETTINGS_STORAGE, userSettings);
      applySettings();
    });
  }

  function samplingParams() {
    const body = {};
    for (const id of NUMERIC) {
      const el = fields[id];
      const n = el ? Number(el.value) : NaN;
      if (el && el.value.trim() !== '' && Number.isFinite(n)) body[id] = n;
    }
    const seed = fields.seed ? fields.seed.value.trim() : '';
    if (seed !== '' && Number.isFinite(Number(seed))) body.seed = Math.trunc(Number(seed));
    return body;
  }

  // ---- rendering ----
  function nearBottom() {
    return list.scrollHeight - list.scrollTop - list.clientHeight < 48;
  }
  function scrollDown(force) {
    if (force) list.scrollTop = list.scrollHeight;
  }

  function figuresText(f) {
    const parts = [];
    if (f.prompt_n != null || f.cache_n != null) {
      const from = f.cache_n && f.tier ? ' from ' + f.tier : '';  // the `reuse` report's tier
      parts.push('prompt: ' + fmt.format(f.prompt_n ?? 0) + ' computed, ' + fmt.format(f.cache_n ?? 0) + ' reused' + from);
    }
    if (f.ttft_ms != null) parts.push('TTFT ' + fmt.format(f.ttft_ms) + ' ms');
    if (f.tps != null) parts.push(f.tps.toFixed(1) + ' tok/s');
    return parts.join(' · ');
  }

  function renderTurn(turn, li = document.createElement('li')) {
    li.className = 'msg ' + turn.role + (turn.role === 'assistant' ? ' ' + turn.state : '');
    li.replaceChildren();
    const content = document.createElement('div');
    content.className = 'content';
    const text = document.createTextNode(turn.content);
    content.append(text);
    li.append(content);
    if (turn.role === 'assistant') {
      if (turn.state === 'stopped') {
        const p = document.createElement('p');
        p.className = 'note';
        p.textContent = 'Stopped.';
        li.append(p);
      } else if (turn.state === 'error') {
        const p = document.createElement('p');
        p.className = 'error';
        p.textContent = turn.error || 'Error';
        li.append(p);
      } else if (turn.state === 'done' && turn.figures) {
        const f = turn.figures;
        const p = document.createElement('p');
        p.className = 'figures';
        const attrs = { 'data-prompt-n': f.prompt_n, 'data-cache-n': f.cache_n, 'data-ttft-ms': f.ttft_ms, 'data-tps': f.tps, 'data-tier': f.tier };
        for (const [k, v] of Object.entries(attrs)) if (v != null) p.setAttribute(k, String(v));
        p.textContent = figuresText(f);
        li.append(p);
      }
    }
    return { li, text };
  }

  function renderAll() {
    list.replaceChildren(...turns.map((t) => renderTurn(t).li));
    scrollDown(true);
  }

  function setBusy(busy) {
    sendBtn.disabled = busy;
    stopBtn.disabled = !busy;
    list.setAttribute('aria-busy', busy ? 'true' : 'false');
  }

  function save() {
    store(CHAT_STORAGE, turns.filter((t) => t.state !== 'streaming'));
  }

  // Previous exchanges whose answer is done or stopped; failed exchanges are left out.
  function conversation() {
    const out = [];
    for (let i = 0; i < turns.length; i++) {
      const t = turns[i];
      const next = turns[i + 1];
      if (t.role === 'user' && next && next.role === 'assistant') {
        if (next.state === 'done' || next.state === 'stopped') {
          out.push({ role: 'user', content: t.content }, { role: 'assistant', content: next.content });
        }
        i++;
      } else if (t.role === 'assistant' && (t.state === 'done' || t.state === 'stopped')) {
        out.push({ role: 'assistant', content: t.content });
      }
    }
    return out;
  }

  // ---- sending ----
  async function send() {
    if (controller) return;
    const text = prompt.value;
    if (!text.trim()) return;

    const messages = [];
    const system = fields.system ? fields.system.value : '';
    if (system.trim()) messages.push({ role: 'system', content: system });
    messages.push(...conversation(), { role: 'user', content: text });
    const body = { messages, stream: true, ...samplingParams(), cache_prompt: true };

    const user = { role: 'user', content: text };
    const answer = { role: 'assistant', content: '', state: 'streaming' };
    turns.push(user, answer);
    list.append(renderTurn(user).li);
    const view = renderTurn(answer);
    list.append(view.li);
    scrollDown(true);
    prompt.value = '';
    save();

    const ctrl = new AbortController();
    controller = ctrl;
    setBusy(true);
    const t0 = performance.now();
    let ttft = null;
    let timings = null;
    let reuse = null;
    try {
      await streamChat(body, {
        signal: ctrl.signal,
        onChunk(chunk) {
          const choice = chunk && Array.isArray(chunk.choices) ? chunk.choices[0] : null;
          const delta = choice && choice.delta ? choice.delta.content : null;
          if (typeof delta === 'string' && delta) {
            if (ttft === null) ttft = Math.round(performance.now() - t0);
            const stick = nearBottom();
            answer.content += delta;
            view.text.appendData(delta);
            scrollDown(stick);
          }
          if (chunk && isObj(chunk.timings)) timings = chunk.timings;
          if (chunk && isObj(chunk.reuse)) reuse = chunk.reuse;  // beside timings, last chunk
        },
      });
      answer.state = 'done';
      const num = (v) => (typeof v === 'number' && Number.isFinite(v) ? v : null);
      answer.figures = {
        prompt_n: timings ? num(timings.prompt_n) : null,
        cache_n: timings ? num(timings.cache_n) : null,
        ttft_ms: ttft,
        tps: timings ? num(timings.predicted_per_second) : null,
        tier: reuse && typeof reuse.tier === 'string' ? reuse.tier : null,
      };
    } catch (err) {
      if (ctrl.signal.aborted) {
        answer.state = 'stopped';
      } else {
        answer.state = 'error';
        answer.error = (err && err.message) || String(err);
        // Let the user resend the same text (e.g. after entering an API key).
        if (!answer.content && !prompt.value) prompt.value = text;
      }
    } finally {
      if (controller === ctrl) controller = null;
      setBusy(false);
      if (turns.includes(answer)) {
        const stick = nearBottom();
        renderTurn(answer, view.li);
        scrollDown(stick);
        save();
      }
      onFinished();
    }
  }

  function stop() {
    if (controller) controller.abort();
  }

  function newChat() {
    stop();
    turns = [];
    save();
    renderAll();
    prompt.focus();
  }

  form.setAttribute('novalidate', '');
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    send();
  });
  prompt.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing && !e.altKey) {
      e.preventDefault();
      if (!controller) form.requestSubmit(sendBtn);
    }
  });
  stopBtn.addEventListener('click', stop);
  $('new-chat').addEventListener('click', newChat);

  applySettings();
  renderAll();
  setBusy(false);

  return {
    applyServerSettings,
    focus: () => prompt.focus(),
  };
}
