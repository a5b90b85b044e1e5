// The chat's conversation: its turns as sent and as shown. A user turn can be edited and resent
// (its Resend submits the chat form, whose run answers that turn again, the turns after it
// dropped); while a reply streams in, the turns' buttons and New chat are disabled.

export const turns = [];  // in order: {message (as sent), element}
let resendAt = null;  // set by a Resend for the run it submits: the turn to answer again

export function takeResend() {
  const at = resendAt;
  resendAt = null;
  return at;
}

function button(text, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.addEventListener("click", onClick);
  return b;
}

export function addTurn(role, message) {
  const element = document.createElement("div");
  element.className = `turn turn-${role}`;
  element.dataset.role = role;
  const name = document.createElement("p");
  name.className = "turn-role";
  name.textContent = role === "user" ? "You" : "Assistant";
  element.append(name);
  document.getElementById("chat-turns").append(element);
  const turn = { message, element };
  turns.push(turn);
  return turn;
}

export function addUserTurn(text) {
  const turn = addTurn("user", { role: "user", content: text });
  turn.text = document.createElement("div");
  turn.text.className = "turn-text";
  turn.text.textContent = text;
  turn.actions = document.createElement("div");
  turn.actions.className = "turn-actions";
  turn.actions.append(button("Edit", () => edit(turn)));
  turn.element.append(turn.text, turn.actions);
  return turn;
}

function edit(turn) {
  const area = document.createElement("textarea");
  area.className = "turn-edit";
  area.rows = 3;
  area.value = turn.message.content;
  area.setAttribute("aria-label", "The message, edited");
  const editButton = turn.actions.firstChild;
  const close = () => {
    area.remove();
    turn.text.hidden = false;
    turn.actions.replaceChildren(editButton);
  };
  const resend = button("Resend", () => {
    turn.message.content = turn.text.textContent = area.value;
    close();
    resendAt = turns.indexOf(turn);
    document.getElementById("chat-form").requestSubmit();
  });
  area.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) resend.click();
    else if (event.key === "Escape") close();
    else return;
    event.preventDefault();
  });
  turn.text.hidden = true;
  turn.text.after(area);
  turn.actions.replaceChildren(resend, button("Cancel", close));
  area.focus();
}

// Drops the turns from `index` on.
export function cut(index) {
  for (const turn of turns.splice(index)) turn.element.remove();
}

export function newChat() {
  cut(0);
}

// No edit, resend or new chat while a reply streams in.
export function lock(on) {
  for (const b of document.querySelectorAll("#chat-turns button, #chat-new")) b.disabled = on;
}
