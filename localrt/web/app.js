// The chat page. It talks only to the server's public API (/api/tags, /api/show, /api/ps, /api/pull,
// /api/chat), so anything it does can be scripted with curl or a client library.

import { ApiError, json, ndjson, onUnauthorized } from "./api.js";
import { copyText, renderMarkdown } from "./markdown.js";
import * as conversations from "./store.js";

const $ = (id) => document.getElementById(id);
const OPTION_DEFAULTS = {
  // the runtime's defaults where neither the request nor the model's Modelfile sets the option
  temperature: "0.8", top_p: "0.9", top_k: "40", min_p: "0", repeat_penalty: "1", presence_penalty: "0",
  frequency_penalty: "0", seed: "random", num_predict: "no limit", num_ctx: "server default",
};
const CURRENT = "localrt.current";
const LAST_MODEL = "localrt.model";

const state = {
  models: [],
  shows: new Map(), // model name -> /api/show answer (capabilities, parameters, system)
  loaded: [],
  conv: null,
  abort: null,
  pending: [], // images attached to the next message: {data (base64), type}
};

// ---- small helpers ----------------------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key in node && typeof value !== "string") node[key] = value;
    else node.setAttribute(key, value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log(n) / Math.log(1024)));
  return `${(n / 1024 ** i).toFixed(i ? 1 : 0)} ${units[i]}`;
}

function say(text, isError = false) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

function randomId() {
  // crypto.randomUUID needs a secure context; a page opened over http at a LAN address is not one
  return [...crypto.getRandomValues(new Uint8Array(16))].map((b) => b.toString(16).padStart(2, "0")).join("");
}

function newConversation(model) {
  return {
    id: randomId(),
    title: "New chat",
    model: model || "",
    created: Date.now(),
    updated: Date.now(),
    settings: { system: "", options: {}, think: "", format: "" },
    messages: [],
  };
}

async function save(conv) {
  conv.updated = Date.now();
  await conversations.put(conv);
  localStorage.setItem(CURRENT, conv.id);
  await renderConversationList();
}

// ---- the API key ------------------------------------------------------------------------------------

function askForKey(refused) {
  const dialog = $("key-dialog");
  $("key-message").textContent = refused
    ? "The server refused that key. Enter the server's API key (LOCALRT_API_KEY)."
    : "This server needs an API key (LOCALRT_API_KEY).";
  $("key-input").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => resolve(dialog.returnValue === "ok" ? $("key-input").value.trim() || null : null),
      { once: true },
    );
    dialog.showModal();
  });
}

// a small modal for a name (rename) or a yes/no (delete), instead of the browser's own prompt()
function ask(title, { label = "", value = "", ok = "OK", input = true } = {}) {
  const dialog = $("ask-dialog");
  $("ask-title").textContent = title;
  $("ask-label").textContent = label;
  $("ask-label").hidden = !input;
  $("ask-input").hidden = !input;
  $("ask-input").value = value;
  $("ask-ok").textContent = ok;
  return new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => resolve(dialog.returnValue === "ok" ? $("ask-input").value : null),
      { once: true },
    );
    dialog.returnValue = "";
    dialog.showModal();
  });
}

// ---- models -----------------------------------------------------------------------------------------

async function refreshModels() {
  const tags = await json("/api/tags");
  state.models = tags.models.map((m) => m.name).sort();
  const select = $("model");
  const chosen = state.conv?.model || localStorage.getItem(LAST_MODEL) || state.models[0] || "";
  select.replaceChildren(
    ...state.models.map((name) => el("option", { value: name }, name)),
  );
  if (!state.models.length) select.append(el("option", { value: "" }, "no models: pull one"));
  if (chosen && !state.models.includes(chosen)) select.append(el("option", { value: chosen }, `${chosen} (missing)`));
  select.value = chosen;
  if (state.conv && !state.conv.model) state.conv.model = chosen;
  await showModel(chosen);
}

async function modelInfo(name) {
  if (!name) return null;
  if (!state.shows.has(name)) state.shows.set(name, await json("/api/show", { method: "POST", body: { model: name } }));
  return state.shows.get(name);
}

function modelParameters(show) {
  const params = {};
  for (const line of (show?.parameters || "").split("\n")) {
    const match = line.trim().match(/^(\S+)\s+(.+)$/);
    if (match && !(match[1] in params)) params[match[1]] = match[2].replace(/^"(.*)"$/, "$1");
  }
  return params;
}

async function showModel(name) {
  let show = null;
  try {
    show = await modelInfo(name);
  } catch (e) {
    say(`${name}: ${e.message}`, true);
  }
  const caps = show?.capabilities || [];
  $("caps").textContent = caps.filter((c) => c !== "completion").join(" · ");
  $("attach").disabled = !caps.includes("vision");
  $("attach").title = caps.includes("vision")
    ? "Attach images (or drop or paste them)"
    : `${name || "this model"} does not take images`;
  $("think-row").hidden = !caps.includes("thinking");
  fillSettings(show);
  document.body.dataset.model = name || "";
}

async function refreshLoaded() {
  let ps;
  try {
    ps = await json("/api/ps");
  } catch (e) {
    if (!(e instanceof ApiError)) throw e;
    return;
  }
  state.loaded = ps.models || [];
  const list = $("loaded");
  if (!state.loaded.length) {
    list.replaceChildren(el("li", { class: "muted" }, "none"));
    return;
  }
  list.replaceChildren(
    ...state.loaded.map((m) => {
      const until = m.expires_at ? new Date(m.expires_at).toLocaleTimeString() : "";
      const where = m.size_vram ? `${bytes(m.size_vram)} on GPU of ${bytes(m.size)}` : `${bytes(m.size)} in RAM`;
      return el(
        "li",
        { class: "loaded-model" },
        el("strong", {}, m.name),
        el("span", { class: "muted" }, ` ${where}, context ${m.context_length ?? "?"}${until ? `, until ${until}` : ""}`),
        el("button", { type: "button", class: "small", "aria-label": `Unload ${m.name}`, onclick: () => unload(m.name) }, "Unload"),
      );
    }),
  );
  fillSettings(state.shows.get($("model").value));
}

async function unload(name) {
  await json("/api/generate", { method: "POST", body: { model: name, keep_alive: 0 } });
  await refreshLoaded();
}

async function pull(event) {
  event.preventDefault();
  const name = $("pull-name").value.trim();
  if (!name) return;
  const bar = $("pull-progress");
  const status = $("pull-status");
  $("pull-button").disabled = true;
  bar.hidden = false;
  bar.value = 0;
  status.classList.remove("error");
  try {
    const body = { model: name, stream: true, insecure: $("pull-insecure").checked };
    for await (const event of ndjson("/api/pull", { method: "POST", body })) {
      if (event.total) {
        bar.max = event.total;
        bar.value = event.completed || 0;
        status.textContent = `${event.status}: ${bytes(event.completed || 0)} of ${bytes(event.total)}`;
      } else {
        status.textContent = event.status;
      }
    }
    status.textContent = `${name}: pulled`;
    await refreshModels();
  } catch (e) {
    status.textContent = `${name}: ${e.message}`;
    status.classList.add("error");
  } finally {
    $("pull-button").disabled = false;
  }
}

// ---- settings ---------------------------------------------------------------------------------------

function fillSettings(show) {
  const conv = state.conv;
  const params = modelParameters(show);
  const loaded = state.loaded.find((m) => m.name === conv?.model);
  for (const input of document.querySelectorAll("[data-option]")) {
    const key = input.dataset.option;
    let fallback = params[key] ?? OPTION_DEFAULTS[key] ?? "";
    if (key === "num_ctx" && !params[key] && loaded?.context_length) fallback = String(loaded.context_length);
    input.placeholder = fallback;
    const value = conv?.settings.options[key];
    input.value = value === undefined ? "" : String(value);
  }
  $("set-system").placeholder = show?.system || "(none)";
  $("set-system").value = conv?.settings.system || "";
  $("set-think").value = conv?.settings.think || "";
  $("set-format").value = conv?.settings.format || "";
  $("set-format").placeholder = "(free text)";
}

function readSettings() {
  const conv = state.conv;
  const options = {};
  for (const input of document.querySelectorAll("[data-option]")) {
    if (input.value.trim() !== "" && Number.isFinite(Number(input.value))) {
      options[input.dataset.option] = Number(input.value);
    }
  }
  conv.settings = {
    system: $("set-system").value,
    options,
    think: $("set-think").value,
    format: $("set-format").value.trim(),
  };
  $("settings-error").textContent = formatOf(conv.settings) instanceof Error ? "The format is neither json nor a JSON schema." : "";
  if (conv.messages.length) save(conv);
}

function formatOf(settings) {
  const text = settings.format;
  if (!text) return undefined;
  if (text === "json") return "json";
  try {
    return JSON.parse(text);
  } catch {
    return new Error("bad format");
  }
}

function toggleSettings(open = $("settings").hidden) {
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
  if (open) $("set-system").focus();
}

// ---- conversations ----------------------------------------------------------------------------------

async function renderConversationList() {
  const all = await conversations.list();
  $("conversations").replaceChildren(
    ...all.map((c) =>
      el(
        "li",
        { class: c.id === state.conv?.id ? "current" : "" },
        el("button", { type: "button", class: "conv-open", onclick: () => openConversation(c.id) }, c.title),
        el("button", { type: "button", class: "small", "aria-label": `Rename ${c.title}`, onclick: () => rename(c.id) }, "Rename"),
        el("button", { type: "button", class: "small", "aria-label": `Delete ${c.title}`, onclick: () => removeConversation(c.id) }, "Delete"),
      ),
    ),
  );
}

async function openConversation(id) {
  stop();
  const conv = id ? await conversations.get(id) : null;
  state.conv = conv || newConversation($("model").value || localStorage.getItem(LAST_MODEL));
  if (conv) localStorage.setItem(CURRENT, conv.id);
  else localStorage.removeItem(CURRENT);
  if (state.conv.model && state.models.includes(state.conv.model)) $("model").value = state.conv.model;
  await showModel(state.conv.model);
  renderMessages();
  await renderConversationList();
  closeSidebar();
  $("prompt").focus();
}

async function rename(id) {
  const conv = id === state.conv?.id ? state.conv : await conversations.get(id);
  const title = await ask("Rename the conversation", { label: "Name", value: conv.title, ok: "Rename" });
  if (title === null || !title.trim()) return;
  conv.title = title.trim();
  await save(conv);
}

async function removeConversation(id) {
  const conv = await conversations.get(id);
  const yes = await ask(`Delete "${conv.title}"?`, { input: false, ok: "Delete" });
  if (yes === null) return;
  await conversations.remove(id);
  if (state.conv?.id === id) await openConversation(null);
  else await renderConversationList();
}

function download(name, type, text) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const link = el("a", { href: url, download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function fileName(conv, ext) {
  return `${(conv.title || "conversation").replace(/[^\w.-]+/g, "-").slice(0, 60)}.${ext}`;
}

function exportJson() {
  download(fileName(state.conv, "json"), "application/json", JSON.stringify(state.conv, null, 2));
}

function exportMarkdown() {
  const conv = state.conv;
  const lines = [`# ${conv.title}`, "", `Model: \`${conv.model}\``, ""];
  if (conv.settings.system) lines.push("## System", "", conv.settings.system, "");
  for (const m of conv.messages) {
    lines.push(`## ${m.role === "user" ? "User" : "Assistant"}`, "");
    if (m.thinking) lines.push("<details><summary>Thinking</summary>", "", m.thinking, "", "</details>", "");
    if (m.images?.length) lines.push(`(${m.images.length} image${m.images.length > 1 ? "s" : ""})`, "");
    lines.push(m.content, "");
  }
  download(fileName(conv, "md"), "text/markdown", lines.join("\n"));
}

// ---- messages ---------------------------------------------------------------------------------------

function statsText(m) {
  const s = m.stats;
  if (!s) return m.stopped ? "stopped" : "";
  const parts = [];
  if (s.eval_count && s.eval_duration) parts.push(`${(s.eval_count / (s.eval_duration / 1e9)).toFixed(1)} tokens/s`);
  if (s.ttft !== null && s.ttft !== undefined) parts.push(`first token ${(s.ttft / 1000).toFixed(2)} s`);
  if (s.prompt_eval_count !== undefined) {
    const used = (s.prompt_eval_count || 0) + (s.eval_count || 0);
    parts.push(`context ${used}${s.num_ctx ? ` / ${s.num_ctx}` : ""} tokens`);
  }
  if (s.done_reason && s.done_reason !== "stop") parts.push(`ended: ${s.done_reason}`);
  if (m.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function messageNode(m, index) {
  const conv = state.conv;
  const body = el("div", { class: "body" });
  if (m.role === "assistant") renderMarkdown(body, m.content);
  else body.textContent = m.content;
  const actions = el("div", { class: "actions" });
  actions.append(el("button", { type: "button", class: "small", onclick: (e) => copyText(m.content, e.target) }, "Copy"));
  if (m.role === "user") {
    actions.append(el("button", { type: "button", class: "small", onclick: () => editMessage(index) }, "Edit"));
  } else if (index === conv.messages.length - 1) {
    actions.append(el("button", { type: "button", class: "small", onclick: () => regenerate() }, "Regenerate"));
  }
  const node = el(
    "article",
    { class: `msg ${m.role}`, "data-index": String(index) },
    el("div", { class: "role" }, m.role === "user" ? "You" : conv.model || "Assistant"),
    m.images?.length
      ? el("div", { class: "images" }, ...m.images.map((img) => el("img", { src: `data:${img.type};base64,${img.data}`, alt: "attached image" })))
      : null,
    m.thinking ? thinkingNode(m.thinking) : null,
    body,
    m.error ? el("p", { class: "error", role: "alert" }, m.error) : null,
    el("div", { class: "stats" }, statsText(m)),
    actions,
  );
  return node;
}

function thinkingNode(text) {
  return el("details", { class: "thinking" }, el("summary", {}, "Thinking"), el("div", { class: "thought" }, text));
}

function renderMessages() {
  const list = $("messages");
  const messages = state.conv?.messages || [];
  list.replaceChildren(...messages.map(messageNode));
  if (!messages.length) list.append(el("p", { class: "empty" }, "Ask anything. Enter sends, Shift+Enter adds a line, Esc stops a reply."));
  list.scrollTop = list.scrollHeight;
}

// A streaming reply is redrawn at most once a frame, however fast the tokens come.
let drawQueued = false;
function redrawLast() {
  if (drawQueued) return;
  drawQueued = true;
  requestAnimationFrame(() => {
    drawQueued = false;
    const list = $("messages");
    const messages = state.conv.messages;
    const index = messages.length - 1;
    const old = list.querySelector(`article[data-index="${index}"]`);
    const wasOpen = old?.querySelector("details.thinking")?.open;
    const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
    const node = messageNode(messages[index], index);
    if (wasOpen) node.querySelector("details.thinking").open = true;
    if (old) old.replaceWith(node);
    else list.append(node);
    if (atBottom) list.scrollTop = list.scrollHeight;
  });
}

function editMessage(index) {
  if (state.abort) return;
  const conv = state.conv;
  const article = $("messages").querySelector(`article[data-index="${index}"]`);
  const area = el("textarea", { class: "edit", "aria-label": "Edit message", rows: "3" });
  area.value = conv.messages[index].content;
  const resend = async () => {
    const edited = { ...conv.messages[index], content: area.value };
    conv.messages = [...conv.messages.slice(0, index), edited];
    renderMessages();
    await generate();
  };
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      resend();
    } else if (e.key === "Escape") {
      e.stopPropagation();
      renderMessages();
    }
  });
  const box = el(
    "div",
    { class: "edit-box" },
    area,
    el("div", { class: "row" },
      el("button", { type: "button", class: "primary", onclick: resend }, "Send"),
      el("button", { type: "button", onclick: () => renderMessages() }, "Cancel")),
  );
  article.querySelector(".body").replaceWith(box);
  area.focus();
}

async function regenerate() {
  if (state.abort) return;
  const conv = state.conv;
  if (conv.messages.at(-1)?.role === "assistant") conv.messages.pop();
  renderMessages();
  await generate();
}

function requestBody(conv) {
  const messages = [];
  if (conv.settings.system) messages.push({ role: "system", content: conv.settings.system });
  for (const m of conv.messages) {
    if (m.role === "assistant" && (m.error || (!m.content && m.stopped))) continue;
    const message = { role: m.role, content: m.content };
    if (m.images?.length) message.images = m.images.map((i) => i.data);
    messages.push(message);
  }
  const body = { model: conv.model, messages, stream: true };
  if (Object.keys(conv.settings.options).length) body.options = { ...conv.settings.options };
  const think = conv.settings.think;
  const thinks = state.shows.get(conv.model)?.capabilities?.includes("thinking");
  if (think && thinks) body.think = think === "true" ? true : think === "false" ? false : think;
  const format = formatOf(conv.settings);
  if (format instanceof Error) throw new Error("The response format in the settings is neither json nor a JSON schema.");
  if (format !== undefined) body.format = format;
  return body;
}

async function generate() {
  const conv = state.conv;
  if (!conv.model) {
    say("Pick a model first (or pull one).", true);
    return;
  }
  const reply = { role: "assistant", content: "", thinking: "" };
  let body;
  try {
    body = requestBody(conv);
  } catch (e) {
    say(e.message, true);
    return;
  }
  conv.messages.push(reply);
  redrawLast();
  const controller = new AbortController();
  state.abort = controller;
  setBusy(true);
  say("");
  const started = performance.now();
  let first = null;
  try {
    for await (const chunk of ndjson("/api/chat", { method: "POST", body, signal: controller.signal })) {
      const m = chunk.message || {};
      if (m.thinking) reply.thinking += m.thinking;
      if (m.content) reply.content += m.content;
      if (first === null && (m.content || m.thinking)) first = performance.now() - started;
      if (chunk.done) {
        const loaded = state.loaded.find((x) => x.name === conv.model);
        reply.stats = {
          ttft: first,
          eval_count: chunk.eval_count,
          eval_duration: chunk.eval_duration,
          prompt_eval_count: chunk.prompt_eval_count,
          prompt_eval_duration: chunk.prompt_eval_duration,
          total_duration: chunk.total_duration,
          load_duration: chunk.load_duration,
          done_reason: chunk.done_reason,
          num_ctx: body.options?.num_ctx ?? loaded?.context_length,
        };
      }
      redrawLast();
    }
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else reply.error = e.message;
  } finally {
    if (state.abort === controller) state.abort = null;
    setBusy(false);
    if (!reply.thinking) delete reply.thinking;
    redrawLast();
    await save(conv);
    await refreshLoaded();
    if (reply.stats && !reply.stats.num_ctx) {
      reply.stats.num_ctx = state.loaded.find((x) => x.name === conv.model)?.context_length;
      await conversations.put(conv);
      redrawLast();
    }
  }
}

function stop() {
  state.abort?.abort();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
  // a screen reader reads the reply once it is whole, not at every redraw of the stream
  $("messages").setAttribute("aria-busy", String(busy));
}

async function send(event) {
  event?.preventDefault();
  if (state.abort) return;
  const prompt = $("prompt");
  const text = prompt.value;
  if (!text.trim() && !state.pending.length) return;
  const conv = state.conv;
  conv.model = $("model").value;
  const message = { role: "user", content: text };
  if (state.pending.length) message.images = state.pending;
  conv.messages.push(message);
  if (conv.title === "New chat") conv.title = text.trim().split("\n")[0].slice(0, 48) || "Images";
  state.pending = [];
  renderAttachments();
  prompt.value = "";
  grow();
  renderMessages();
  await save(conv);
  await generate();
}

// ---- images -----------------------------------------------------------------------------------------

async function attach(files) {
  const images = [...files].filter((f) => f.type.startsWith("image/"));
  if (!images.length) return;
  const model = $("model").value;
  const show = await modelInfo(model).catch(() => null);
  if (!show?.capabilities?.includes("vision")) {
    say(`${model || "This model"} does not take images: pick a vision model.`, true);
    return;
  }
  for (const file of images) {
    const url = await new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
    state.pending.push({ type: file.type, data: url.slice(url.indexOf(",") + 1) });
  }
  renderAttachments();
}

function renderAttachments() {
  $("attachments").replaceChildren(
    ...state.pending.map((img, i) =>
      el(
        "figure",
        { class: "thumb" },
        el("img", { src: `data:${img.type};base64,${img.data}`, alt: `attachment ${i + 1}` }),
        el("button", {
          type: "button", class: "small", "aria-label": `Remove attachment ${i + 1}`,
          onclick: () => { state.pending.splice(i, 1); renderAttachments(); },
        }, "×"),
      ),
    ),
  );
}

// ---- layout and keys --------------------------------------------------------------------------------

function grow() {
  const prompt = $("prompt");
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight, 240)}px`;
}

function closeSidebar() {
  document.body.classList.remove("sidebar-open");
  $("scrim").hidden = true;
  $("menu").setAttribute("aria-expanded", "false");
}

function toggleSidebar() {
  const open = !document.body.classList.contains("sidebar-open");
  document.body.classList.toggle("sidebar-open", open);
  $("scrim").hidden = !open;
  $("menu").setAttribute("aria-expanded", String(open));
}

function wire() {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("prompt").addEventListener("input", grow);
  $("prompt").addEventListener("paste", (e) => {
    if (e.clipboardData?.files?.length) {
      e.preventDefault();
      attach(e.clipboardData.files);
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.abort) {
      e.preventDefault();
      stop();
    }
  });
  const main = document.querySelector("main");
  main.addEventListener("dragover", (e) => {
    e.preventDefault();
    main.classList.add("dropping");
  });
  main.addEventListener("dragleave", () => main.classList.remove("dropping"));
  main.addEventListener("drop", (e) => {
    e.preventDefault();
    main.classList.remove("dropping");
    attach(e.dataTransfer.files);
  });
  $("attach").addEventListener("click", () => $("file").click());
  $("file").addEventListener("change", () => {
    attach($("file").files);
    $("file").value = "";
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => openConversation(null));
  $("model").addEventListener("change", async () => {
    const model = $("model").value;
    localStorage.setItem(LAST_MODEL, model);
    state.conv.model = model;
    if (state.conv.messages.length) await save(state.conv);
    await showModel(model);
  });
  $("menu").addEventListener("click", toggleSidebar);
  $("scrim").addEventListener("click", closeSidebar);
  $("settings-toggle").addEventListener("click", () => toggleSettings());
  $("settings-close").addEventListener("click", () => toggleSettings(false));
  $("settings-form").addEventListener("input", readSettings);
  $("settings-form").addEventListener("change", readSettings);
  $("settings-reset").addEventListener("click", () => {
    state.conv.settings = { system: "", options: {}, think: "", format: "" };
    fillSettings(state.shows.get($("model").value));
    readSettings();
  });
  $("export-json").addEventListener("click", exportJson);
  $("export-md").addEventListener("click", exportMarkdown);
  $("pull-form").addEventListener("submit", pull);
}

async function start() {
  wire();
  onUnauthorized(askForKey);
  state.conv = newConversation(localStorage.getItem(LAST_MODEL));
  try {
    await refreshModels();
    await refreshLoaded();
    const current = localStorage.getItem(CURRENT);
    await openConversation(current && (await conversations.get(current)) ? current : null);
    document.body.dataset.ready = "true";
  } catch (e) {
    say(e instanceof ApiError && e.status === 401 ? "This server needs an API key: reload to enter it." : e.message, true);
  }
}

start();
