/* The runs index's filters, as progressive enhancement: without this script the form stays hidden and the
 * table lists every run. Each <select> of form#runs-filter narrows table#runs-table's rows by their data
 * attributes: data-model and data-problem must equal the chosen value; GPU and status are matched together
 * against data-grades ("gpu:status gpu:status"), so "H200" + "wrong" shows runs graded wrong on the H200.
 * The choice is kept in the page's query string (?model=…&gpu=…), so a filtered list can be linked to.
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

  function init() {
    var form = document.getElementById("runs-filter");
    var table = document.getElementById("runs-table");
    var count = document.getElementById("runs-count");
    if (!form || !table || !table.tBodies.length) return;
    var rows = Array.prototype.slice.call(table.tBodies[0].rows);
    var total = rows.length;

    function apply() {
      var want = {}, query = [];
      FIELDS.forEach(function (name) {
        want[name] = form.elements[name].value;
        if (want[name]) query.push(name + "=" + encodeURIComponent(want[name]));
      });
      var shown = 0;
      rows.forEach(function (row) {
        var ok = matches(row, want);
        row.hidden = !ok;
        if (ok) shown += 1;
      });
      count.textContent = shown === total
        ? total + (total === 1 ? " run" : " runs")
        : shown + " of " + total + " runs shown";
      if (window.history && window.history.replaceState) {
        window.history.replaceState(null, "", (query.length ? "?" + query.join("&") : location.pathname) + location.hash);
      }
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
