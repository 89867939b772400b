// The chat page's DOM helpers: element lookup, element creation, the error banner.

export const $ = (id) => document.getElementById(id);

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function showBanner(text) {
  const banner = $("error-banner");
  banner.textContent = text;
  banner.hidden = !text;
}
