/* Sortable tables, as progressive enhancement: without this script a table.sortable is complete and in its
 * documented order. Each header with data-sort="num" or "text" becomes a button; a click sorts the body by
 * that column's data-sort-value (else its text), first in data-sort-first order ("ascending" by default),
 * then the other way. Blank values always go last; ties keep the page's order. aria-sort names the sorted
 * header. No inline script and no other host: it runs under script-src 'self'. */
(function () {
  "use strict";

  function value(cell, type) {
    if (!cell) return null;
    var raw = cell.hasAttribute("data-sort-value") ? cell.getAttribute("data-sort-value") : cell.textContent;
    raw = raw.trim();
    if (raw === "" || raw === "\u2014") return null;
    if (type === "num") {
      var n = Number(raw);
      return isFinite(n) ? n : null;
    }
    return raw.toLocaleLowerCase();
  }

  function compare(a, b, type) {
    if (type === "num") return a - b;
    return a.localeCompare(b);
  }

  function sortTable(table, headers, th, index, direction) {
    var body = table.tBodies[0];
    var type = th.getAttribute("data-sort");
    var sign = direction === "descending" ? -1 : 1;
    var rows = Array.prototype.slice.call(body.rows).map(function (row) {
      return { row: row, key: value(row.cells[index], type), order: Number(row.getAttribute("data-order")) };
    });
    rows.sort(function (x, y) {
      if (x.key === null || y.key === null) {
        if (x.key === null && y.key === null) return x.order - y.order;
        return x.key === null ? 1 : -1;
      }
      return sign * compare(x.key, y.key, type) || x.order - y.order;
    });
    rows.forEach(function (r) { body.appendChild(r.row); });
    headers.forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", direction);
  }

  function enhance(table) {
    if (!table.tHead || !table.tBodies.length) return;
    Array.prototype.forEach.call(table.tBodies[0].rows, function (row, i) {
      row.setAttribute("data-order", String(i));
    });
    var headers = Array.prototype.slice.call(table.tHead.rows[0].cells);
    headers.forEach(function (th, index) {
      if (!th.hasAttribute("data-sort")) return;
      var button = document.createElement("button");
      button.type = "button";
      button.className = "sort-button";
      while (th.firstChild) button.appendChild(th.firstChild);
      th.appendChild(button);
      th.addEventListener("click", function () {  // the whole header cell; the button's click bubbles here
        var now = th.getAttribute("aria-sort");
        var direction = now === "ascending" ? "descending"
          : now === "descending" ? "ascending"
          : (th.getAttribute("data-sort-first") || "ascending");
        sortTable(table, headers, th, index, direction);
      });
    });
    table.classList.add("sort-ready");
  }

  function init() {
    Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), enhance);
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
