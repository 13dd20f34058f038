// Wiring: model info from GET props, the chat panel, the cache panel, the API key dialog.
import { getJSON, getApiKey, setApiKey, onUnauthorized } from './api.js';
import { createChat } from './chat.js';
import { createCachePanel } from './cache-view.js';

const $ = (id) => document.getElementById(id);

const cache = createCachePanel();
const chat = createChat({ onFinished: () => cache.refresh() });

let propsLoaded = false;

async function loadProps() {
  try {
    const props = await getJSON('props');
    propsLoaded = true;
    const name = typeof props.model_alias === 'string' && props.model_alias ? props.model_alias : 'unknown';
    $('model').textContent = name;
    document.title = name + ' · radixserve';
    const info = [];
    const gen = props.default_generation_settings;
    if (gen && typeof gen.n_ctx === 'number') info.push('ctx ' + gen.n_ctx.toLocaleString('en-US'));
    if (typeof props.total_slots === 'number') info.push(props.total_slots + (props.total_slots === 1 ? ' slot' : ' slots'));
    $('model-info').textContent = info.length ? '(' + info.join(', ') + ')' : '';
    chat.applyServerSettings(props.ui_settings, gen && gen.params);
  } catch (err) {
    const unauthorized = err && err.status === 401;
    $('model').textContent = unauthorized ? '(API key needed)'
      : err && err.status === 503 ? 'loading…' : 'unavailable';
    $('model').title = (err && err.message) || '';
    // still loading (503) or unreachable: ask again; a 401 waits for the key dialog
    if (!unauthorized) setTimeout(loadProps, 2000);
  }
}

// ---- API key dialog ----
const dialog = $('key-dialog');
const keyInput = $('key-input');
const keyMessage = $('key-message');

function openKeyDialog(message) {
  keyMessage.textContent = message;
  if (dialog.open) return;
  keyInput.value = getApiKey();
  dialog.showModal();
  keyInput.focus();
  keyInput.select();
}

onUnauthorized((err) => {
  cache.pause();
  openKeyDialog(getApiKey()
    ? 'The server rejected the saved API key (' + err.message + '). Enter another one.'
    : 'This server needs an API key.');
});

$('key-form').addEventListener('submit', (e) => {
  e.preventDefault();
  setApiKey(keyInput.value.trim());
  dialog.close('saved');
  cache.resume();
  if (!propsLoaded) loadProps();
  chat.focus();
});
$('key-cancel').addEventListener('click', () => dialog.close('cancel'));
$('key-button').addEventListener('click', () => openKeyDialog('The key is kept in this browser and sent with every request.'));

loadProps();
cache.start();
