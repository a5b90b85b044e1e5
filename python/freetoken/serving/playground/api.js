// Talking to the server: JSON and SSE requests carrying the API key, errors as the server's
// message. Every request is recorded so the page can show it as curl and Python.

const KEY_STORE = "freetoken-api-key";

export const keyRequired = document.documentElement.dataset.keyRequired === "true";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
}

class ApiError extends Error {
  constructor(status, error) {
    const kind = [error.type, error.code].filter(Boolean).join(", ");
    super(error.message || "the server gave no message");
    this.detail = `${status ? `HTTP ${status}` : "stream error"}${kind ? ` (${kind})` : ""}` +
      (error.param ? `, param: ${error.param}` : "");
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h.Authorization = `Bearer ${apiKey()}`;
  return h;
}

async function failure(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error) return new ApiError(response.status, body.error);
  } catch (_) { /* not JSON: the text itself is the message */ }
  return new ApiError(response.status, { message: text || response.statusText });
}

// A log of one run's requests: {method, path, body, status}.
export class RequestLog {
  constructor() { this.entries = []; }

  add(method, path, body) {
    const entry = { method, path, body, status: null };
    this.entries.push(entry);
    return entry;
  }
}

// Sends a request, recorded in `log`; a refusal throws the server's error.
async function send(method, path, body, log, signal) {
  const entry = log?.add(method, path, body);
  const init = { method, headers: headers(), signal };
  if (body !== null) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (entry) entry.status = response.status;
  if (!response.ok) throw await failure(response);
  return response;
}

export async function getJSON(path, log) {
  return (await send("GET", path, null, log)).json();
}

export async function postJSON(path, body, log, signal) {
  return (await send("POST", path, body, log, signal)).json();
}

// Streams a request's SSE events to onEvent(data) until [DONE]; an error event throws.
export async function postStream(path, body, log, signal, onEvent) {
  const response = await send("POST", path, body, log, signal);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const parsed = JSON.parse(data);
      if (parsed.error) throw new ApiError(0, parsed.error);
      onEvent(parsed);
    }
  }
}
