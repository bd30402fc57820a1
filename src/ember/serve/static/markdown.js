// A small Markdown renderer for model answers: fenced code, headings, lists, quotes, tables, rules,
// paragraphs, and inline code, bold, italic, strike-through and links.
// Safety: every piece of the source is HTML-escaped before any tag is added, so model output can never
// inject markup; links are kept only for http(s) and mailto addresses.
// It is re-run on the whole answer at every streamed token, so an unclosed fence renders as code at once.
"use strict";

(function () {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

  function escapeHtml(text) {
    return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  // Inline spans. Code spans are cut out first so that nothing inside them is formatted.
  function inline(text) {
    const parts = text.split(/(`+[^`]*?`+)/);
    return parts
      .map((part, i) => {
        if (i % 2 === 1) {
          const code = part.replace(/^`+|`+$/g, "");
          return `<code>${escapeHtml(code)}</code>`;
        }
        return emphasis(escapeHtml(part));
      })
      .join("");
  }

  // Runs on already-escaped text: the patterns only add tags around it.
  function emphasis(s) {
    return s
      .replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (whole, label, url) =>
        /^(https?:\/\/|mailto:)/i.test(url)
          ? `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`
          : whole,
      )
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/__(?=\S)([\s\S]*?\S)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*(?=\S)([^*]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=\S)([^_]*?\S)_(?![_\w])/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  }

  const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s{0,3}>\s?/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  function cells(row) {
    return row
      .trim()
      .replace(/^\||\|$/g, "")
      .split("|")
      .map((c) => c.trim());
  }

  function blocks(lines) {
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i++;
      } else if ((m = line.match(FENCE))) {
        const marker = m[1];
        const lang = m[2];
        const body = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(marker)) body.push(lines[i++]);
        i++; // the closing fence (absent while the answer is still streaming)
        const cls = lang ? ` class="language-${escapeHtml(lang)}"` : "";
        out.push(`<pre><code${cls}>${escapeHtml(body.join("\n"))}</code></pre>`);
      } else if ((m = line.match(HEADING))) {
        const level = m[1].length;
        out.push(`<h${level}>${inline(m[2])}</h${level}>`);
        i++;
      } else if (RULE.test(line)) {
        out.push("<hr>");
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].replace(QUOTE, ""));
        out.push(`<blockquote>${blocks(body)}</blockquote>`);
      } else if (ITEM.test(line)) {
        i = list(lines, i, out);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
        const head = cells(line);
        i += 2;
        const rows = [];
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(cells(lines[i++]));
        const th = head.map((c) => `<th>${inline(c)}</th>`).join("");
        const tr = rows.map((r) => `<tr>${r.map((c) => `<td>${inline(c)}</td>`).join("")}</tr>`).join("");
        out.push(`<table><thead><tr>${th}</tr></thead><tbody>${tr}</tbody></table>`);
      } else {
        const para = [];
        while (i < lines.length && lines[i].trim() && !isBlockStart(lines[i])) para.push(lines[i++]);
        out.push(`<p>${para.map((l) => inline(l.trim())).join("<br>")}</p>`);
      }
    }
    return out.join("");
  }

  // A list and its items; an item's indented continuation lines (nested lists, code) render as blocks.
  function list(lines, i, out) {
    const first = lines[i].match(ITEM);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const start = ordered ? parseInt(first[2], 10) : 1;
    const items = [];
    while (i < lines.length) {
      const m = lines[i].match(ITEM);
      if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
      const body = [m[3]];
      i++;
      while (i < lines.length) {
        const next = lines[i];
        const nested = next.match(ITEM);
        if (!next.trim()) {
          // A blank line ends the list unless the next line is still indented under this item.
          if (i + 1 < lines.length && /^\s+\S/.test(lines[i + 1]) && lines[i + 1].search(/\S/) > indent) {
            body.push("");
            i++;
            continue;
          }
          break;
        }
        if (nested && nested[1].length <= indent) break;
        if (!nested && next.search(/\S/) <= indent && isBlockStart(next)) break;
        body.push(next.slice(Math.min(next.search(/\S/), indent + 2)));
        i++;
      }
      items.push(body);
    }
    const html = items
      .map((body) => {
        const rest = body.slice(1);
        const tail = rest.length ? blocks(rest) : "";
        return `<li>${inline(body[0])}${tail}</li>`;
      })
      .join("");
    const tag = ordered ? "ol" : "ul";
    const attr = ordered && start !== 1 ? ` start="${start}"` : "";
    out.push(`<${tag}${attr}>${html}</${tag}>`);
    return i;
  }

  function renderMarkdown(source) {
    return blocks(source.replace(/\r\n?/g, "\n").split("\n"));
  }

  window.renderMarkdown = renderMarkdown;
  window.escapeHtml = escapeHtml;
})();
