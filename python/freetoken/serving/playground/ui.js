// What every mode shares: the error banner, the settings as request fields, and the list of a
// run's requests with their curl and Python copies.

import { apiKey } from "./api.js";
import { curl, python } from "./code.js";

export function showError(error) {
  const box = document.getElementById("error");
  box.replaceChildren();
  const message = document.createElement("strong");
  message.textContent = error.message || String(error);
  box.append(message);
  if (error.detail) box.append(` ${error.detail}`);
  box.hidden = false;
}

export function clearError() {
  const box = document.getElementById("error");
  box.hidden = true;
  box.replaceChildren();
}

export const value = (id) => document.getElementById(id).value;
const number = (id) => (value(id).trim() === "" ? null : Number(value(id)));

// The side panel: `sampling` as request fields (both endpoints name them alike), `k` the number
// of alternatives (null: no probabilities asked for), `reasoning` "", "on" or "off".
export function settings() {
  const stop = value("stop").split("\n").filter((s) => s !== "");
  return {
    sampling: {
      temperature: number("temperature"),
      top_p: number("top-p"),
      seed: number("seed"),
      max_tokens: number("max-tokens"),
      stop: stop.length ? stop : null,
    },
    k: number("top-logprobs"),
    reasoning: value("reasoning"),
  };
}

// Drops null fields, so a request holds only what the user set.
export function compact(body) {
  return Object.fromEntries(Object.entries(body).filter(([, v]) => v !== null && v !== undefined));
}

export function status(text) {
  document.getElementById("status").textContent = text;
}

async function copy(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  // Plain http to another host is not a secure context: the clipboard API is absent there.
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

// The run's requests, each with its status, its code and two copy buttons.
export function renderRequests(container, log) {
  const section = document.createElement("details");
  section.className = "requests";
  const summary = document.createElement("summary");
  summary.textContent = `Requests of this run (${log.entries.length}): copy as curl or Python`;
  section.append(summary);
  const withKey = Boolean(apiKey());
  for (const entry of log.entries) {
    const item = document.createElement("div");
    item.className = "request";
    const title = document.createElement("p");
    title.textContent = `${entry.method} ${entry.path} → ${entry.status ?? "no answer"}`;
    item.append(title);
    const code = {
      curl: curl(location.origin, entry, withKey),
      Python: python(location.origin, entry, withKey),
    };
    for (const [name, text] of Object.entries(code)) {
      const button = document.createElement("button");
      button.type = "button";
      button.className = `copy copy-${name.toLowerCase()}`;
      button.textContent = `Copy as ${name}`;
      button.addEventListener("click", async () => {
        try {
          await copy(text);
          status(`Copied the ${entry.path} request as ${name}`);
          button.textContent = "Copied";
        } catch (error) {
          showError(error);
        }
        setTimeout(() => { button.textContent = `Copy as ${name}`; }, 1500);
      });
      item.append(button);
    }
    for (const [name, text] of Object.entries(code)) {
      const pre = document.createElement("pre");
      pre.className = `code code-${name.toLowerCase()}`;
      pre.textContent = text;
      pre.setAttribute("aria-label", `${entry.path} as ${name}`);
      item.append(pre);
    }
    section.append(item);
  }
  if (withKey) {
    const note = document.createElement("p");
    note.className = "hint";
    note.textContent = "The code reads the key from $FREETOKEN_API_KEY.";
    section.append(note);
  }
  container.append(section);
}

// Finish reason and usage, under an output.
export function renderMeta(container, finish, usage) {
  const meta = document.createElement("p");
  meta.className = "meta";
  const parts = [`finish_reason: ${finish ?? "—"}`];
  if (usage) {
    for (const name of ["prompt_tokens", "completion_tokens", "total_tokens"]) {
      parts.push(`${name}: ${usage[name]}`);
    }
  }
  meta.textContent = parts.join(" · ");
  container.append(meta);
}
