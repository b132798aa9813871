// A small Markdown renderer for model replies: text in, DOM nodes out.
//
// It never parses HTML: every piece of the reply becomes a text node or an element made here with
// document.createElement, so a reply holding <script> or <img onerror=...> shows those characters
// and runs nothing. Links are kept only for http:, https: and mailto: URLs; images become links
// (the page fetches nothing from elsewhere).
//
// Blocks: fenced code (``` or ~~~, an unclosed fence runs to the end, as in a reply still
// streaming), ATX headings, paragraphs (a single newline is a line break), bullet and numbered
// lists (nested by indentation), block quotes, horizontal rules, pipe tables.
// Inline: `code`, **strong**, *emphasis* (and the _ forms), ~~strike~~, [links](url),
// ![images](url) as links, bare http(s) URLs, backslash escapes.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
const TABLE_DIVIDER = /^ *\|? *:?-+:? *(?:\| *:?-+:? *)*\|? *$/;
const SAFE_URL = /^(?:https?:\/\/|mailto:)/i;
const BARE_URL = /^https?:\/\/[^\s<>"'`]*[^\s<>"'`.,;:!?)\]]/i;
const ESCAPABLE = "\\`*_{}[]()#+-.!|~<>\"'";

function element(tag, className, children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  for (const child of children || []) node.append(child);
  return node;
}

function indentOf(line) {
  return line.length - line.replace(/^ +/, "").length;
}

function blank(line) {
  return line.trim() === "";
}

// Does `line` open a block other than a paragraph (so a paragraph ends before it)?
function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST_ITEM.test(line);
}

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  const cells = [];
  let cell = "";
  for (let i = 0; i < row.length; i++) {
    if (row[i] === "\\" && row[i + 1] === "|") {
      cell += "|";
      i++;
    } else if (row[i] === "|") {
      cells.push(cell.trim());
      cell = "";
    } else {
      cell += row[i];
    }
  }
  cells.push(cell.trim());
  return cells;
}

function codeBlock(language, lines) {
  const code = element("code", language ? "language-" + language : "", [lines.join("\n")]);
  const pre = element("pre", "", [code]);
  const label = element("span", "code-language", [language || "text"]);
  const copy = element("button", "copy-code", ["Copy"]);
  copy.type = "button";
  return element("div", "code-block", [element("div", "code-header", [label, copy]), pre]);
}

function table(header, alignments, rows) {
  const cellsOf = (cells, tag) => cells.map((text, column) => {
    const cell = element(tag, "", renderInline(text));
    if (alignments[column]) cell.className = "align-" + alignments[column];
    return cell;
  });
  const width = header.length;
  const head = element("thead", "", [element("tr", "", cellsOf(header, "th"))]);
  const body = element("tbody", "", rows.map((row) => {
    const cells = row.slice(0, width);
    while (cells.length < width) cells.push("");
    return element("tr", "", cellsOf(cells, "td"));
  }));
  return element("div", "table-wrap", [element("table", "", [head, body])]);
}

// The lines of one list item (the marker's line, then its indented or lazy continuation lines),
// with the item's own indentation taken off; `next` is the index after it.
function listItemLines(lines, start, contentIndent) {
  const first = LIST_ITEM.exec(lines[start]);
  const item = [first[3] || ""];
  let i = start + 1;
  while (i < lines.length) {
    const line = lines[i];
    if (blank(line)) {
      // A blank line continues the item only when an indented line follows it.
      let j = i;
      while (j < lines.length && blank(lines[j])) j++;
      if (j < lines.length && indentOf(lines[j]) >= contentIndent) {
        for (; i < j; i++) item.push("");
        continue;
      }
      break;
    }
    if (indentOf(line) >= contentIndent) {
      item.push(line.slice(contentIndent));
    } else if (!startsBlock(line) && !blank(item[item.length - 1])) {
      item.push(line.trim()); // a lazy continuation of the item's paragraph
    } else {
      break;
    }
    i++;
  }
  return { item, next: i };
}

function list(lines, start) {
  const first = LIST_ITEM.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const node = element(ordered ? "ol" : "ul");
  if (ordered) {
    const number = parseInt(first[2], 10);
    if (number !== 1) node.start = number;
  }
  const baseIndent = first[1].length;
  let i = start;
  while (i < lines.length) {
    const match = LIST_ITEM.exec(lines[i]);
    if (!match || match[1].length !== baseIndent || /\d/.test(match[2]) !== ordered) break;
    const contentIndent = Math.min(match[1].length + match[2].length + 1, baseIndent + 6);
    const { item, next } = listItemLines(lines, i, Math.max(contentIndent, baseIndent + 2));
    const li = element("li");
    const tight = !item.slice(0, -1).some(blank);
    const blocks = renderBlocks(item);
    // A tight item's lone paragraph is shown without its margins.
    if (tight && blocks.length && blocks[0].tagName === "P") {
      li.append(...blocks[0].childNodes, ...blocks.slice(1));
    } else {
      li.append(...blocks);
    }
    node.append(li);
    i = next;
    while (i < lines.length && blank(lines[i])) {
      const after = lines.slice(i).find((line) => !blank(line));
      const again = after !== undefined && LIST_ITEM.exec(after);
      if (!again || again[1].length !== baseIndent) return { node, next: i };
      i++;
    }
  }
  return { node, next: i };
}

// Block elements for `lines` (an array of strings).
function renderBlocks(lines) {
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (blank(line)) {
      i++;
      continue;
    }
    let match;
    if ((match = FENCE.exec(line))) {
      const fence = match[1];
      const indent = indentOf(line);
      const code = [];
      i++;
      while (i < lines.length) {
        const closing = lines[i].trim();
        if (closing.length >= fence.length && closing === fence[0].repeat(closing.length) && indentOf(lines[i]) < 4) {
          i++;
          break;
        }
        code.push(lines[i].slice(Math.min(indent, indentOf(lines[i]))));
        i++;
      }
      blocks.push(codeBlock(match[2], code));
    } else if ((match = HEADING.exec(line))) {
      blocks.push(element("h" + match[1].length, "", renderInline(match[2] || "")));
      i++;
    } else if (RULE.test(line)) {
      blocks.push(element("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && !blank(lines[i])) {
        const inner = QUOTE.exec(lines[i]);
        if (!inner && startsBlock(lines[i])) break;
        quoted.push(inner ? inner[1] : lines[i]);
        i++;
      }
      blocks.push(element("blockquote", "", renderBlocks(quoted)));
    } else if (LIST_ITEM.test(line)) {
      const { node, next } = list(lines, i);
      blocks.push(node);
      i = next;
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_DIVIDER.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      const header = splitRow(line);
      const alignments = splitRow(lines[i + 1]).map((cell) => {
        const left = cell.startsWith(":");
        const right = cell.endsWith(":");
        return left && right ? "center" : right ? "right" : left ? "left" : "";
      });
      const rows = [];
      i += 2;
      while (i < lines.length && !blank(lines[i]) && lines[i].includes("|")) {
        rows.push(splitRow(lines[i]));
        i++;
      }
      blocks.push(table(header, alignments, rows));
    } else {
      const paragraph = [];
      while (i < lines.length && !blank(lines[i]) && (paragraph.length === 0 || !startsBlock(lines[i]))) {
        paragraph.push(lines[i].trim());
        i++;
      }
      const children = [];
      paragraph.forEach((text, index) => {
        if (index > 0) children.push(element("br"));
        children.push(...renderInline(text));
      });
      blocks.push(element("p", "", children));
    }
  }
  return blocks;
}

// Where the closing `delimiter` of an emphasis opened at `from` is, or -1.
function closingDelimiter(text, delimiter, from) {
  for (let i = from; i < text.length; i++) {
    if (text[i] === "\\") {
      i++;
    } else if (text[i] === "`") {
      const run = /^`+/.exec(text.slice(i))[0];
      const end = text.indexOf(run, i + run.length);
      if (end > 0) i = end + run.length - 1;
    } else if (text.startsWith(delimiter, i) && i > from && !/\s/.test(text[i - 1])) {
      if (delimiter[0] === "_" && /\w/.test(text[i + delimiter.length] || "")) continue;
      if (delimiter.length === 1 && text[i + 1] === delimiter) {
        i++; // part of a longer run: not this emphasis's end
        continue;
      }
      return i;
    }
  }
  return -1;
}

// The link at `start` ("[text](url)"): {label, url, end} or null.
function linkAt(text, start) {
  let depth = 0;
  let close = -1;
  for (let i = start; i < text.length; i++) {
    if (text[i] === "\\") i++;
    else if (text[i] === "[") depth++;
    else if (text[i] === "]" && --depth === 0) {
      close = i;
      break;
    }
  }
  if (close < 0 || text[close + 1] !== "(") return null;
  const target = /^\(\s*<?([^\s<>()]*(?:\([^\s()]*\)[^\s<>()]*)*)>?(?:\s+"[^"]*")?\s*\)/.exec(text.slice(close + 1));
  if (!target) return null;
  return { label: text.slice(start + 1, close), url: target[1], end: close + 1 + target[0].length };
}

function link(url, children) {
  if (!SAFE_URL.test(url)) return children;
  const anchor = element("a", "", children);
  anchor.href = url;
  anchor.target = "_blank";
  anchor.rel = "noopener noreferrer";
  return [anchor];
}

// Inline nodes (text nodes and elements) for one line or cell of text.
export function renderInline(text) {
  const nodes = [];
  let plain = "";
  const flush = () => {
    if (plain) nodes.push(document.createTextNode(plain));
    plain = "";
  };
  let i = 0;
  while (i < text.length) {
    const rest = text.slice(i);
    const character = text[i];
    if (character === "\\" && i + 1 < text.length && ESCAPABLE.includes(text[i + 1])) {
      plain += text[i + 1];
      i += 2;
      continue;
    }
    if (character === "`") {
      const run = /^`+/.exec(rest)[0];
      const end = text.indexOf(run, i + run.length);
      if (end > 0 && text[end + run.length] !== "`") {
        flush();
        let code = text.slice(i + run.length, end);
        if (/^ .*[^ ].* $/.test(code)) code = code.slice(1, -1);
        nodes.push(element("code", "", [code]));
        i = end + run.length;
        continue;
      }
      plain += run;
      i += run.length;
      continue;
    }
    const emphasis = [["**", "strong"], ["__", "strong"], ["~~", "del"], ["*", "em"], ["_", "em"]]
      .find(([delimiter]) => rest.startsWith(delimiter));
    if (emphasis) {
      const [delimiter, tag] = emphasis;
      const opens = rest.length > delimiter.length && !/\s/.test(rest[delimiter.length])
        && !(delimiter[0] === "_" && i > 0 && /\w/.test(text[i - 1]));
      const end = opens ? closingDelimiter(text, delimiter, i + delimiter.length) : -1;
      if (end > 0) {
        flush();
        nodes.push(element(tag, "", renderInline(text.slice(i + delimiter.length, end))));
        i = end + delimiter.length;
        continue;
      }
      plain += delimiter;
      i += delimiter.length;
      continue;
    }
    if (character === "[" || (character === "!" && text[i + 1] === "[")) {
      const image = character === "!";
      const found = linkAt(text, image ? i + 1 : i);
      if (found) {
        flush();
        const label = image ? [found.label || found.url] : renderInline(found.label);
        nodes.push(...link(found.url, label));
        i = found.end;
        continue;
      }
    }
    if ((character === "h" || character === "H") && (i === 0 || !/\w/.test(text[i - 1]))) {
      const url = BARE_URL.exec(rest);
      if (url) {
        flush();
        nodes.push(...link(url[0], [url[0]]));
        i += url[0].length;
        continue;
      }
    }
    plain += character;
    i++;
  }
  flush();
  return nodes;
}

// A DocumentFragment showing `text` (Markdown) as HTML, built from DOM nodes only.
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  fragment.append(...renderBlocks(String(text).replace(/\r\n?/g, "\n").split("\n")));
  return fragment;
}
