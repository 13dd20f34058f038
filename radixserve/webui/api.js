// Fetch helpers: API key, JSON GET, streaming chat (SSE).
// Every URL is relative so the page also works under --api-prefix.

const KEY_STORAGE = 'radixserve.apiKey';
let memoryKey = '';  // fallback when localStorage is unavailable

export class ApiError extends Error {
  constructor(message, status = 0, type = '') {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.type = type;
  }
}

const unauthorizedListeners = new Set();

/** Register fn(err), called whenever a request answers 401. */
export function onUnauthorized(fn) {
  unauthorizedListeners.add(fn);
}

export function getApiKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || '';
  } catch {
    return memoryKey;
  }
}

export function setApiKey(key) {
  memoryKey = key || '';
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    // storage disabled: keep the in-memory copy
  }
}

function headers(extra) {
  const h = { Accept: 'application/json', ...extra };
  const key = getApiKey();
  if (key) h.Authorization = 'Bearer ' + key;
  return h;
}

function messageOf(error) {
  if (!error) return 'Unknown error';
  if (typeof error === 'string') return error;
  return String(error.message || error.type || JSON.stringify(error));
}

async function errorFrom(res) {
  let message = ('HTTP ' + res.status + ' ' + (res.statusText || '')).trim();
  let type = '';
  try {
    const text = await res.text();
    try {
      const body = JSON.parse(text);
      if (body && body.error) {
        message = messageOf(body.error);
        type = (body.error && body.error.type) || '';
      } else if (body && body.detail) {
        message = typeof body.detail === 'string' ? body.detail : JSON.stringify(body.detail);
      }
    } catch {
      if (text) message += ': ' + text.slice(0, 200);
    }
  } catch {
    // body unreadable: keep the status line
  }
  const err = new ApiError(message, res.status, type);
  if (res.status === 401) {
    for (const fn of unauthorizedListeners) fn(err);
  }
  return err;
}

/** GET a JSON document; throws ApiError on a non-2xx answer. */
export async function getJSON(path, { signal } = {}) {
  const res = await fetch(path, { headers: headers(), signal, cache: 'no-store' });
  if (!res.ok) throw await errorFrom(res);
  return res.json();
}

/**
 * POST v1/chat/completions with stream: true and feed every parsed chunk to onChunk.
 * Resolves at `data: [DONE]` or the end of the stream; rejects with ApiError on an HTTP
 * error or an error chunk, and with the abort reason when `signal` is aborted.
 */
export async function streamChat(body, { signal, onChunk }) {
  const res = await fetch('v1/chat/completions', {
    method: 'POST',
    headers: headers({ 'Content-Type': 'application/json', Accept: 'text/event-stream' }),
    body: JSON.stringify(body),
    signal,
    cache: 'no-store',
  });
  if (!res.ok) throw await errorFrom(res);

  // Returns true at [DONE].
  const handleEvent = (block) => {
    const data = [];
    for (const line of block.split('\n')) {
      if (!line || line[0] === ':') continue;  // blank or comment (ping)
      const colon = line.indexOf(':');
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? '' : line.slice(colon + 1);
      if (value[0] === ' ') value = value.slice(1);
      if (field === 'data') data.push(value);
    }
    if (!data.length) return false;
    const text = data.join('\n');
    if (text.trim() === '[DONE]') return true;
    let chunk;
    try {
      chunk = JSON.parse(text);
    } catch {
      throw new ApiError('Malformed stream data: ' + text.slice(0, 120));
    }
    if (chunk && chunk.error) {
      throw new ApiError(messageOf(chunk.error), chunk.error.code || 0, chunk.error.type || '');
    }
    onChunk(chunk);
    return false;
  };

  if (!res.body) {  // no streaming support: parse the whole answer at once
    const all = (await res.text()).replace(/\r\n?/g, '\n');
    for (const block of all.split('\n\n')) if (handleEvent(block)) break;
    return;
  }

  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      buf += done ? decoder.decode() : decoder.decode(value, { stream: true });
      // Normalise line ends, holding back a trailing CR that may pair with the next LF.
      const hold = !done && buf.endsWith('\r');
      if (hold) buf = buf.slice(0, -1);
      buf = buf.replace(/\r\n?/g, '\n') + (hold ? '\r' : '');
      let cut;
      while ((cut = buf.indexOf('\n\n')) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        if (handleEvent(block)) return;
      }
      if (done) {
        if (buf.trim()) handleEvent(buf);
        return;
      }
    }
  } finally {
    reader.cancel().catch(() => {});  // closes the connection early on [DONE], errors, aborts
  }
}
