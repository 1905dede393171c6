// A reply's Markdown as safe DOM. Three layers keep a model's text from running in the page: raw HTML in
// the Markdown is shown as text (never parsed), DOMPurify cleans what marked made, and the page's
// Content-Security-Policy runs no inline script. Images in a reply become links: nothing is fetched.

import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.mjs";
import hljs from "./vendor/highlight/core.min.js";
import bash from "./vendor/highlight/languages/bash.min.js";
import c from "./vendor/highlight/languages/c.min.js";
import cpp from "./vendor/highlight/languages/cpp.min.js";
import css from "./vendor/highlight/languages/css.min.js";
import diff from "./vendor/highlight/languages/diff.min.js";
import go from "./vendor/highlight/languages/go.min.js";
import java from "./vendor/highlight/languages/java.min.js";
import javascript from "./vendor/highlight/languages/javascript.min.js";
import jsonLang from "./vendor/highlight/languages/json.min.js";
import markdown from "./vendor/highlight/languages/markdown.min.js";
import plaintext from "./vendor/highlight/languages/plaintext.min.js";
import python from "./vendor/highlight/languages/python.min.js";
import rust from "./vendor/highlight/languages/rust.min.js";
import shell from "./vendor/highlight/languages/shell.min.js";
import sql from "./vendor/highlight/languages/sql.min.js";
import typescript from "./vendor/highlight/languages/typescript.min.js";
import xml from "./vendor/highlight/languages/xml.min.js";
import yaml from "./vendor/highlight/languages/yaml.min.js";

const LANGUAGES = {
  bash, c, cpp, css, diff, go, java, javascript, json: jsonLang, markdown, plaintext, python, rust,
  shell, sql, typescript, xml, yaml,
};
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);

export function escapeHtml(text) {
  return String(text)
    .replaceAll("&", "&amp;")
    .replaceAll("<", "&lt;")
    .replaceAll(">", "&gt;")
    .replaceAll('"', "&quot;")
    .replaceAll("'", "&#39;");
}

function safeHref(href) {
  try {
    const url = new URL(href, location.href);
    return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

const marked = new Marked({ gfm: true, breaks: false });
marked.use({
  renderer: {
    html(token) {
      return escapeHtml(token.text ?? token.raw ?? "");
    },
    code(token) {
      const lang = (token.lang || "").match(/^[\w+#.-]*/)[0];
      return `<pre><code data-lang="${escapeHtml(lang)}">${escapeHtml(token.text)}</code></pre>\n`;
    },
    image(token) {
      const href = safeHref(token.href);
      const label = escapeHtml(token.text || token.href || "image");
      return href ? `<a href="${escapeHtml(href)}">[image: ${label}]</a>` : `[image: ${label}]`;
    },
  },
});

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    const href = safeHref(node.getAttribute("href") || "");
    if (href) node.setAttribute("href", href);
    else node.removeAttribute("href");
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

const PURIFY = {
  FORBID_TAGS: ["style", "img", "svg", "math", "form", "input", "button", "textarea", "select", "iframe"],
  FORBID_ATTR: ["style", "class", "id"],
  ALLOW_DATA_ATTR: false,
  ADD_ATTR: ["data-lang"],
};

export function renderMarkdown(target, text) {
  const html = DOMPurify.sanitize(marked.parse(text), { ...PURIFY, RETURN_DOM_FRAGMENT: true });
  for (const code of html.querySelectorAll("pre > code")) highlight(code);
  target.replaceChildren(html);
}

function highlight(code) {
  const lang = (code.dataset.lang || "").toLowerCase();
  const text = code.textContent;
  const pre = code.parentElement;
  pre.classList.add("code");
  if (lang && hljs.getLanguage(lang)) {
    code.innerHTML = hljs.highlight(text, { language: lang, ignoreIllegals: true }).value;
    code.classList.add("hljs");
  }
  const bar = document.createElement("div");
  bar.className = "code-bar";
  const name = document.createElement("span");
  name.textContent = lang || "text";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", "Copy code");
  copy.addEventListener("click", () => copyText(text, copy));
  bar.append(name, copy);
  pre.prepend(bar);
}

export async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // not a secure context (an http page on a LAN address): the old way
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  if (button) {
    const was = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => {
      button.textContent = was;
    }, 1200);
  }
}
