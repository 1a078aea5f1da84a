/* The runs index's filters, as progressive enhancement: without this script the form stays hidden and the
 * table lists every run. Each <select> of form#runs-filter narrows table#runs-table's rows by their data
 * attributes: data-model and data-problem must equal the chosen value; GPU and status are matched together
 * against data-grades ("gpu:status gpu:status"), so "H200" + "wrong" shows runs graded wrong on the H200.
 * The choice is kept in the page's query string (?model=…&gpu=…), so a filtered list can be linked to.
 * When the index has several pages (the table carries data-all, the address of runs.json), a filter looks
 * at every run: the rows come from that file (fetched once), drawn like the page's own, in place of them,
 * and the pager is hidden until the filter is cleared.
 * No inline script and no other host: it runs under script-src 'self'. */
(function () {
  "use strict";

  var FIELDS = ["model", "gpu", "problem", "status"];

  function matches(row, want) {
    if (want.model && row.getAttribute("data-model") !== want.model) return false;
    if (want.problem && row.getAttribute("data-problem") !== want.problem) return false;
    if (!want.gpu && !want.status) return true;
    var grades = (row.getAttribute("data-grades") || "").split(" ");
    for (var i = 0; i < grades.length; i++) {
      var cut = grades[i].lastIndexOf(":");
      if (cut < 0) continue;
      var gpu = grades[i].slice(0, cut), status = grades[i].slice(cut + 1);
      if ((!want.gpu || gpu === want.gpu) && (!want.status || status === want.status)) return true;
    }
    return false;
  }

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    (children || []).forEach(function (c) { node.append(c); });
    return node;
  }

  function fill(pattern, keys) {
    return pattern.replace(/\{(\w+)\}/g, function (_, k) { return encodeURIComponent(keys[k]); });
  }

  /* One row of runs.json as the page draws its own (templates/runs.html). */
  function drawRow(table, all, r) {
    var runId = r[0], grades = r[8], cut = r[5].indexOf("/");
    var runHref = function (gpu) { return fill(table.getAttribute("data-run-href"), {gpu: gpu, run_id: runId}); };
    var head = el("th", {scope: "row", "data-sort-value": runId},
                  [grades.length ? el("a", {href: runHref(grades[0][0])}, [el("code", {}, [runId])]) : el("code", {}, [runId])]);
    var model = el("td", {}, [el("a", {href: fill(table.getAttribute("data-model-href"), {model: r[2]})}, [r[3]])]);
    if (r[4]) model.append(" ", el("span", {"class": "tag house-tag"}, [r[4]]));
    var problem = el("td", {}, [el("a", {href: fill(table.getAttribute("data-problem-href"),
                                                    {bench: r[5].slice(0, cut), problem: r[5].slice(cut + 1)})},
                                    [all.problems[r[5]] || r[5]])]);
    var graded = el("td", {"class": "grades"}, []);
    grades.forEach(function (g) {
      var line = el("span", {"class": "grade"}, [el("a", {href: runHref(g[0])}, [all.gpus[g[0]] || g[0]]), " ",
                                                 el("span", {"class": "chip tone-" + g[3]}, [g[2]])]);
      if (g[4]) line.append(" " + g[4]);
      if (g[5]) line.append(" ", el("span", {"class": "muted"}, ["imported"]));
      graded.append(line, " ");
    });
    if (!grades.length) graded.append(el("span", {"class": "muted"}, ["not graded yet"]));
    var row = el("tr", {"data-model": r[1], "data-problem": r[5],
                        "data-grades": grades.map(function (g) { return g[0] + ":" + g[1]; }).join(" ")},
                 [head, model, problem, graded, el("td", {"data-sort-value": r[6]}, [r[7]])]);
    return row;
  }

  function init() {
    var form = document.getElementById("runs-filter");
    var table = document.getElementById("runs-table");
    var count = document.getElementById("runs-count");
    if (!form || !table || !table.tBodies.length) return;
    var body = table.tBodies[0];
    var own = Array.prototype.slice.call(body.rows);  // this page's rows
    var ownCount = count.textContent;
    var pagers = Array.prototype.slice.call(document.querySelectorAll("nav.pager"));
    var source = table.getAttribute("data-all");  // several pages: filter every run, from runs.json
    var every = null;  // all runs' rows, drawn once runs.json has come
    var loading = null;

    function everyRow(then) {
      if (every) return then();
      if (!loading) {
        count.textContent = "loading every run…";
        loading = fetch(source).then(function (r) {
          if (!r.ok) throw new Error(source + ": HTTP " + r.status);
          return r.json();
        }).then(function (all) {
          every = all.runs.map(function (r) { return drawRow(table, all, r); });
        });
      }
      loading.then(then, function (err) { count.textContent = "could not load every run (" + err.message + ")"; });
    }

    function show(rows, want, total, filtered) {
      var shown = 0;
      rows.forEach(function (row) {
        var ok = matches(row, want);
        row.hidden = !ok;
        if (ok) shown += 1;
      });
      if (!filtered && source) {
        count.textContent = ownCount;
      } else {
        count.textContent = shown === total
          ? total + (total === 1 ? " run" : " runs")
          : shown + " of " + total + " runs shown";
      }
    }

    function apply() {
      var want = {}, query = [];
      FIELDS.forEach(function (name) {
        want[name] = form.elements[name].value;
        if (want[name]) query.push(name + "=" + encodeURIComponent(want[name]));
      });
      var filtered = query.length > 0;
      if (window.history && window.history.replaceState) {
        window.history.replaceState(null, "", (query.length ? "?" + query.join("&") : location.pathname) + location.hash);
      }
      if (!source || !filtered) {
        if (source) body.replaceChildren.apply(body, own);
        pagers.forEach(function (nav) { nav.hidden = false; });
        show(own, want, own.length, filtered);
        return;
      }
      everyRow(function () {
        var now = {};  // the form may have changed while runs.json was on its way
        FIELDS.forEach(function (name) { now[name] = form.elements[name].value; });
        if (!FIELDS.some(function (name) { return now[name]; })) return;
        body.replaceChildren.apply(body, every);
        pagers.forEach(function (nav) { nav.hidden = true; });
        show(every, now, every.length, true);
      });
    }

    var params = new URLSearchParams(location.search);
    FIELDS.forEach(function (name) {
      var select = form.elements[name], value = params.get(name);
      if (value && Array.prototype.some.call(select.options, function (o) { return o.value === value; })) {
        select.value = value;
      }
    });
    form.addEventListener("change", apply);
    form.addEventListener("reset", function () {  // fires before the form resets: clear, then filter, now
      FIELDS.forEach(function (name) { form.elements[name].value = ""; });
      apply();
    });
    form.addEventListener("submit", function (event) { event.preventDefault(); });
    form.hidden = false;
    apply();
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
