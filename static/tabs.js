/* GPU tabs on the home page, as progressive enhancement: one tablist per bench section. Without this
 * script every GPU's board is shown, one section after another, and the links in each nav[data-tabs]
 * jump to them. With it, each nav's links become tabs (ARIA tablist, arrow keys, Home/End) and one
 * section per bench shows at a time; the URL hash keeps the choice (#hard-h200), and a hash pointing
 * inside a section (a board's anchor) opens that section. Each tablist only answers hashes that point
 * into its own panels, so choosing a GPU under Mega leaves the Hard tabs as they were.
 * Runs under script-src 'self'. */
(function () {
  "use strict";

  function init(nav) {
    var links = [], panels = [];
    Array.prototype.forEach.call(nav.querySelectorAll("a[href^='#']"), function (a) {
      var panel = document.getElementById(decodeURIComponent(a.getAttribute("href").slice(1)));
      if (panel && panel.tagName === "SECTION" && panel.classList.contains("tab-panel")) {
        links.push(a);
        panels.push(panel);
      }
    });
    if (links.length < 2) return;  // one GPU: nothing to choose, the section stays as it is
    nav.setAttribute("role", "tablist");
    nav.classList.add("tabs");
    Array.prototype.forEach.call(nav.children, function (child) {
      if (links.indexOf(child) < 0) child.setAttribute("role", "presentation");  // the "GPUs:" label
    });

    function select(i, focus) {
      links.forEach(function (a, j) {
        var on = i === j;
        a.setAttribute("aria-selected", on ? "true" : "false");
        a.tabIndex = on ? 0 : -1;
        panels[j].hidden = !on;
      });
      if (focus) links[i].focus();
    }

    function fromHash() {
      var target = location.hash ? document.getElementById(decodeURIComponent(location.hash.slice(1))) : null;
      for (var i = 0; target && i < panels.length; i++) {
        if (panels[i].contains(target)) return i;
      }
      return -1;
    }

    function choose(i, focus) {
      select(i, focus);
      if (history.replaceState) history.replaceState(null, "", "#" + panels[i].id);
    }

    links.forEach(function (a, i) {
      a.setAttribute("role", "tab");
      if (!a.id) a.id = "tab-" + panels[i].id;
      a.setAttribute("aria-controls", panels[i].id);
      panels[i].setAttribute("role", "tabpanel");
      panels[i].setAttribute("aria-labelledby", a.id);
      panels[i].classList.add("tabbed");
      a.addEventListener("click", function (event) {
        event.preventDefault();
        choose(i, false);
      });
      a.addEventListener("keydown", function (event) {
        var next = {ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: links.length - 1}[event.key];
        if (next === undefined) return;
        event.preventDefault();
        choose((next + links.length) % links.length, true);
      });
    });
    window.addEventListener("hashchange", function () {
      var i = fromHash();
      if (i >= 0) select(i, false);
    });
    var start = fromHash();
    select(start >= 0 ? start : 0, false);
    if (start >= 0) document.getElementById(decodeURIComponent(location.hash.slice(1))).scrollIntoView();
  }

  Array.prototype.forEach.call(document.querySelectorAll("nav[data-tabs]"), init);
})();
