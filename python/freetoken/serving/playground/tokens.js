// Token spans shaded by probability, and the tooltip that shows a token's logprob, rank and
// alternatives (or another element's facts) on hover or focus. Inside a token list the arrow
// keys move between tokens (one tab stop per list), so a long output does not swallow the Tab
// key.

const tooltip = () => document.getElementById("tooltip");

export const percentOf = (p) => `${(100 * p).toFixed(2)} %`;
const percent = (logprob) => percentOf(Math.exp(logprob));
export const shown = (text) => JSON.stringify(text);

// A token list: a container whose children are token spans (and plain text runs).
export function tokenList(label, name) {
  const list = document.createElement("div");
  list.className = `tokens label-${label}`;
  list.setAttribute("role", "group");
  list.setAttribute("aria-label", name);
  list.addEventListener("keydown", (event) => moveFocus(list, event));
  return list;
}

// entry: {text (as shown), token (the API's string, if not the text), logprob, rank (null: not
// in the top k), top: [{token, logprob}], k, note}.
export function addToken(list, label, entry) {
  const span = document.createElement("span");
  span.className = "tok";
  span.dataset.label = label;
  span.dataset.logprob = String(entry.logprob);
  // A line break shows as a mark inside the token, and breaks the line after it.
  span.textContent = entry.text.replaceAll("\n", "↵");
  if (!entry.text) span.classList.add("blank");
  span.style.setProperty("--p", Math.exp(entry.logprob).toFixed(4));
  span.tabIndex = list.querySelector(".tok") ? -1 : 0;
  span.entry = { ...entry, label };
  withTooltip(span, (box) => tokenTip(box, span.entry));
  list.append(span);
  const breaks = entry.text.split("\n").length - 1;
  if (breaks) list.append("\n".repeat(breaks));
  return span;
}

// Text the API gave no logprob entry for (probabilities off, or a token the parser hid).
export function addText(list, label, text) {
  const span = document.createElement("span");
  span.className = "plain";
  span.dataset.label = label;
  span.textContent = text;
  list.append(span);
}

function moveFocus(list, event) {
  const tokens = [...list.querySelectorAll(".tok")];
  const at = tokens.indexOf(document.activeElement);
  if (at < 0) return;
  const to = { ArrowRight: at + 1, ArrowDown: at + 1, ArrowLeft: at - 1, ArrowUp: at - 1,
    Home: 0, End: tokens.length - 1 }[event.key];
  if (to === undefined) {
    if (event.key === "Escape") hide(tokens[at]);
    return;
  }
  event.preventDefault();
  const next = tokens[Math.max(0, Math.min(tokens.length - 1, to))];
  tokens[at].tabIndex = -1;
  next.tabIndex = 0;
  next.focus();
}

// Shows the tooltip beside `element` while it is hovered or focused, filled by fill(box).
export function withTooltip(element, fill) {
  const open = () => show(element, fill), close = () => hide(element);
  for (const kind of ["mouseenter", "focus"]) element.addEventListener(kind, open);
  for (const kind of ["mouseleave", "blur"]) element.addEventListener(kind, close);
}

function tokenTip(box, entry) {
  const { text, token = text, logprob, rank, top, k, label, note } = entry;
  const head = document.createElement("p");
  head.className = "tip-token";
  head.textContent = shown(text);
  const facts = document.createElement("p");
  facts.textContent = `${label} · logprob ${logprob.toFixed(4)} · p ${percent(logprob)} · ` +
    `rank ${rank ?? (k ? `> ${k}` : "not asked")}`;
  box.append(head, facts);
  if (note) {
    const p = document.createElement("p");
    p.className = "hint";
    p.textContent = note;
    box.append(p);
  }
  if (top.length) {
    const list = document.createElement("ol");
    list.className = "alternatives";
    for (const alt of top) {
      const item = document.createElement("li");
      if (alt.token === token && alt.logprob === logprob) item.className = "chosen";
      const name = document.createElement("code");
      name.textContent = shown(alt.token);
      item.append(name, ` ${percent(alt.logprob)} (${alt.logprob.toFixed(4)})`);
      list.append(item);
    }
    box.append(list);
  }
}

function show(element, fill) {
  const box = tooltip();
  box.replaceChildren();
  fill(box);
  box.hidden = false;
  element.setAttribute("aria-describedby", "tooltip");
  const rect = element.getBoundingClientRect();
  const width = box.offsetWidth, height = box.offsetHeight;
  const left = Math.max(4, Math.min(rect.left, window.innerWidth - width - 4));
  const below = rect.bottom + 6 + height < window.innerHeight;
  box.style.setProperty("left", `${left}px`);
  box.style.setProperty("top", `${below ? rect.bottom + 6 : Math.max(4, rect.top - height - 6)}px`);
}

function hide(element) {
  element.removeAttribute("aria-describedby");
  tooltip().hidden = true;
}
