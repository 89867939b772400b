// Safe Markdown: model text never becomes markup.
//
// A small Markdown subset (fenced code, headings, lists, quotes, rules, paragraphs; inline
// code, bold, italics, strikethrough, http(s)/mailto links) rendered by creating elements and
// setting textContent: the text is never parsed as HTML, so `<script>` stays text.

import { el } from "./dom.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const LIST_ITEM = /^ {0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;
const INLINE =
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__(?!\w)|\*(?=[^\s*])([\s\S]*?[^\s*])\*|(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)|~~(?=\S)([\s\S]*?\S)~~|\[([^\]\n]+)\]\(([^()\s]+)\)/g;
const SAFE_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

/** A link's URL if it is http(s) or mailto, resolved against the page; otherwise null. */
function safeUrl(raw) {
  try {
    const url = new URL(raw, location.href);
    return SAFE_PROTOCOLS.has(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

/** Inline Markdown of `text` appended to `parent`, as text nodes and formatting elements. */
function renderInline(text, parent) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.append(text.slice(last, match.index));
    const [whole, , code, strong1, strong2, em1, em2, del, linkText, linkUrl] = match;
    if (code !== undefined) {
      parent.append(el("code", null, code));
    } else if (strong1 !== undefined || strong2 !== undefined) {
      renderInline(strong1 ?? strong2, parent.appendChild(el("strong")));
    } else if (em1 !== undefined || em2 !== undefined) {
      renderInline(em1 ?? em2, parent.appendChild(el("em")));
    } else if (del !== undefined) {
      renderInline(del, parent.appendChild(el("del")));
    } else {
      const href = safeUrl(linkUrl);
      if (href) {
        const a = el("a");
        a.href = href;
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        renderInline(linkText, a);
        parent.append(a);
      } else {
        parent.append(whole); // a javascript: or data: link stays visible as plain text
      }
    }
    last = match.index + whole.length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function codeBlock(lang, lines) {
  const wrapper = el("div", "code-block");
  const header = el("div", "code-header");
  header.append(el("span", "code-lang", lang || "code"));
  const copy = el("button", "copy-code", "Copy");
  copy.type = "button";
  const code = el("code", null, lines.join("\n"));
  if (lang) code.dataset.lang = lang;
  copy.addEventListener("click", () => {
    // The clipboard API exists only on https or localhost.
    if (!navigator.clipboard) {
      copy.textContent = "Select the text to copy";
      return;
    }
    navigator.clipboard.writeText(code.textContent).then(
      () => (copy.textContent = "Copied"),
      () => (copy.textContent = "Copy failed"),
    );
  });
  header.append(copy);
  const pre = el("pre");
  pre.append(code);
  wrapper.append(header, pre);
  return wrapper;
}

/** Markdown `text` as a DocumentFragment; safe for any input, including partial streams
 * (an unclosed code fence runs to the end). */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  const startsBlock = (line) =>
    FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    LIST_ITEM.test(line);
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      const fence = m[1];
      const body = [];
      i += 1;
      while (i < lines.length && !isClosingFence(lines[i], fence)) body.push(lines[i++]);
      i += 1; // the closing fence, if any
      fragment.append(codeBlock(m[2], body));
    } else if ((m = HEADING.exec(line))) {
      const heading = el(`h${Math.min(m[1].length + 2, 6)}`, "md-heading");
      renderInline(m[2], heading);
      fragment.append(heading);
      i += 1;
    } else if (RULE.test(line)) {
      fragment.append(el("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        body.push(m[1]);
        i += 1;
      }
      const quote = el("blockquote");
      quote.append(renderMarkdown(body.join("\n")));
      fragment.append(quote);
    } else if ((m = LIST_ITEM.exec(line))) {
      const ordered = /\d/.test(m[1]);
      const list = el(ordered ? "ol" : "ul");
      if (ordered && parseInt(m[1], 10) !== 1) list.start = parseInt(m[1], 10);
      while (i < lines.length && (m = LIST_ITEM.exec(lines[i])) && /\d/.test(m[1]) === ordered) {
        const item = el("li");
        const body = [m[2]];
        i += 1;
        // Indented lines continue the item.
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !LIST_ITEM.test(lines[i])) {
          body.push(lines[i++].trim());
        }
        renderInline(body.join("\n"), item);
        list.append(item);
      }
      fragment.append(list);
    } else {
      const body = [line];
      i += 1;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) body.push(lines[i++]);
      const paragraph = el("p");
      renderInline(body.join("\n"), paragraph);
      fragment.append(paragraph);
    }
  }
  return fragment;
}

function isClosingFence(line, fence) {
  const trimmed = line.trim();
  return trimmed.length >= fence.length && trimmed === fence[0].repeat(trimmed.length);
}
