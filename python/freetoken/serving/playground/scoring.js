// Scoring mode (docs/scoring.md, "Whole labels"): one /generative_scoring request whose items
// are the prompts after an empty query (so each is tokenized as a completion prompt is). Every
// label is scored whole, its total logprob teacher-forced through all its tokens, and the
// totals are renormalised over the labels: labels of any length, sharing tokens or not.

import { postJSON } from "./api.js";
import { percentOf, shown, withTooltip } from "./tokens.js";
import { value } from "./ui.js";

const SVG = "http://www.w3.org/2000/svg";

function scoringInput() {
  const prompts = value("scoring-prompts").split(/^---$/m)
    .map((p) => p.replace(/^\n/, "").replace(/\n$/, "")).filter((p) => p.trim());
  const labels = value("scoring-labels").split("\n").filter((l) => l.trim());
  if (!prompts.length) throw new Error("Give at least one prompt.");
  if (labels.length < 2) throw new Error("Give at least two labels, one a line.");
  return { prompts, labels };
}

// A label's name that shows its tokens (as the response lists them) on hover or focus.
function labelName(element, entry) {
  element.textContent = shown(entry.label);
  element.setAttribute("tabindex", "0");
  withTooltip(element, (box) => {
    const head = document.createElement("p");
    head.className = "tip-token";
    head.textContent = shown(entry.label);
    const count = entry.tokens.length;
    const facts = document.createElement("p");
    facts.textContent = `${count} token${count === 1 ? "" : "s"}, scored together`;
    const list = document.createElement("ol");
    list.className = "label-tokens";
    entry.tokens.forEach((token, i) => {
      const item = document.createElement("li");
      const name = document.createElement("code");
      name.textContent = shown(token);
      item.append(name, ` id ${entry.token_ids[i]}`);
      list.append(item);
    });
    box.append(head, facts, list);
  });
  return element;
}

function chart(prompt, scores) {
  const rowHeight = 28, labelWidth = 140, barWidth = 300, width = labelWidth + barWidth + 170;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("viewBox", `0 0 ${width} ${rowHeight * scores.length + 4}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `Label probabilities for ${shown(prompt)}: ` +
    scores.map((s) => `${s.label.trim() || shown(s.label)} ${percentOf(s.prob)}`).join(", "));
  scores.forEach((s, i) => {
    const y = i * rowHeight + 2;
    const name = labelName(document.createElementNS(SVG, "text"), s);
    name.setAttribute("x", labelWidth - 8);
    name.setAttribute("y", y + rowHeight / 2 + 5);
    name.setAttribute("text-anchor", "end");
    const back = document.createElementNS(SVG, "rect");
    back.setAttribute("class", "bar-back");
    back.setAttribute("x", labelWidth);
    back.setAttribute("y", y + 4);
    back.setAttribute("width", barWidth);
    back.setAttribute("height", rowHeight - 8);
    const bar = document.createElementNS(SVG, "rect");
    bar.setAttribute("class", "bar");
    bar.setAttribute("x", labelWidth);
    bar.setAttribute("y", y + 4);
    bar.setAttribute("width", (barWidth * s.prob).toFixed(2));
    bar.setAttribute("height", rowHeight - 8);
    bar.dataset.label = s.label;
    bar.dataset.prob = String(s.prob);
    const figure = document.createElementNS(SVG, "text");
    figure.setAttribute("x", labelWidth + barWidth + 8);
    figure.setAttribute("y", y + rowHeight / 2 + 5);
    figure.textContent = `${percentOf(s.prob)}  (${s.logprob.toFixed(4)})`;
    svg.append(name, back, bar, figure);
  });
  return svg;
}

function table(rows) {
  const t = document.createElement("table");
  t.className = "scores";
  t.createCaption().textContent =
    "Probability renormalised over the labels, and the label's total logprob";
  const head = t.createTHead().insertRow();
  const column = (name) => {
    const th = document.createElement("th");
    th.scope = "col";
    head.append(th);
    return th;
  };
  column().textContent = "Prompt";
  for (const s of rows[0].scores) labelName(column(), s);
  column().textContent = "Most likely";
  const body = t.createTBody();
  for (const { prompt, scores } of rows) {
    const row = body.insertRow();
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = prompt;
    row.append(th);
    const best = scores.reduce((a, b) => (b.prob > a.prob ? b : a));
    for (const s of scores) {
      const cell = row.insertCell();
      cell.className = "score";
      if (s === best) cell.classList.add("best");
      cell.dataset.prob = String(s.prob);
      cell.dataset.logprob = String(s.logprob);
      const bar = document.createElement("span");
      bar.className = "cell-bar";
      bar.style.setProperty("--w", s.prob.toFixed(4));
      cell.append(bar, `${percentOf(s.prob)} (${s.logprob.toFixed(4)})`);
    }
    row.insertCell().textContent = shown(best.label);
  }
  return t;
}

export async function runScoring(output, model, log, signal) {
  const { prompts, labels } = scoringInput();
  const body = { ...(model ? { model } : {}), query: "", items: prompts, labels };
  const response = await postJSON("/generative_scoring", body, log, signal);
  const rows = response.data.map((d) => ({ prompt: prompts[d.index], scores: d.labels }));
  if (rows.length === 1) output.append(chart(rows[0].prompt, rows[0].scores));
  output.append(table(rows));
}
