// The page's wiring: tabs, the API key, the model's name, and one run per form submission.

import { apiKey, getJSON, keyRequired, RequestLog, setApiKey } from "./api.js";
import { EXAMPLE_TOOLS, runChat } from "./chat.js";
import { runCompletion } from "./completion.js";
import { runScoring } from "./scoring.js";
import { newChat } from "./turns.js";
import { clearError, renderRequests, showError, status } from "./ui.js";

const RUNS = { chat: runChat, completion: runCompletion, scoring: runScoring };
let model = null;

function selectTab(tab) {
  for (const other of document.querySelectorAll("[role=tab]")) {
    const selected = other === tab;
    other.setAttribute("aria-selected", String(selected));
    other.tabIndex = selected ? 0 : -1;
    document.getElementById(other.getAttribute("aria-controls")).hidden = !selected;
  }
  history.replaceState(null, "", `#${tab.id.replace("tab-", "")}`);
}

function setUpTabs() {
  const tabs = [...document.querySelectorAll("[role=tab]")];
  for (const tab of tabs) {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", (event) => {
      const at = tabs.indexOf(tab);
      const moves = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: tabs.length - 1 };
      const to = moves[event.key];
      if (to === undefined) return;
      event.preventDefault();
      const next = tabs[(to + tabs.length) % tabs.length];
      selectTab(next);
      next.focus();
    });
  }
  const wanted = document.getElementById(`tab-${location.hash.slice(1)}`);
  if (wanted) selectTab(wanted);
}

async function loadModel() {
  const label = document.getElementById("model-name");
  model = null;
  if (keyRequired && !apiKey()) {
    const link = document.createElement("a");
    link.href = "#api-key";
    link.textContent = "Enter the API key to start.";
    link.addEventListener("click", (event) => {
      event.preventDefault();
      document.getElementById("api-key").focus();
    });
    label.replaceChildren(link);
    return;
  }
  try {
    const models = await getJSON("/v1/models");
    model = models.data[0]?.id ?? null;
    label.textContent = model ? `Model: ${model}` : "";
    clearError();
  } catch (error) {
    label.textContent = "";
    showError(error);
  }
}

function setUpKey() {
  const input = document.getElementById("api-key");
  input.value = apiKey();
  input.required = keyRequired;
  document.getElementById("key-hint").textContent =
    `(this server needs ${keyRequired ? "one" : "none"})`;
  input.addEventListener("change", () => {
    setApiKey(input.value.trim());
    loadModel();
  });
}

function setUpForm(panel) {
  const mode = panel.dataset.mode;
  const form = panel.querySelector("form");
  const output = panel.querySelector(".output");
  const send = form.querySelector("button[type=submit]");
  const stop = form.querySelector(".stop");
  let controller = null;
  stop?.addEventListener("click", () => controller?.abort());
  form.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (controller) return;
    clearError();
    output.replaceChildren();
    delete output.dataset.done;
    output.setAttribute("aria-busy", "true");
    controller = new AbortController();
    send.disabled = true;
    if (stop) stop.disabled = false;
    const log = new RequestLog();
    status(`${mode}: running`);
    try {
      await RUNS[mode](output, model, log, controller.signal);
      status(`${mode}: done`);
    } catch (error) {
      if (error.name !== "AbortError") showError(error);
      status(error.name === "AbortError" ? `${mode}: stopped` : `${mode}: failed`);
    } finally {
      if (log.entries.length) renderRequests(output, log);
      output.setAttribute("aria-busy", "false");
      output.dataset.done = "true";
      controller = null;
      send.disabled = false;
      if (stop) stop.disabled = true;
    }
  });
}

setUpTabs();
setUpKey();
for (const panel of document.querySelectorAll("[role=tabpanel]")) setUpForm(panel);
document.getElementById("chat-tools-example").addEventListener("click", () => {
  document.getElementById("chat-tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
});
document.getElementById("chat-new").addEventListener("click", newChat);
loadModel();
