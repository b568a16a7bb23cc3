// veribus view: the only script. Filters apply on change; pages of a running run refresh
// their #live section every 3 s until the run is no longer running. No external requests.
(function () {
  "use strict";
  function onChangeSubmit() {
    document.querySelectorAll("form.filters select").forEach(function (sel) {
      sel.addEventListener("change", function () { sel.form.submit(); });
    });
  }
  function live() {
    if (document.body.dataset.live !== "1") return;
    var timer = setInterval(function () {
      fetch(window.location.href, { headers: { "Accept": "text/html" }, cache: "no-store" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (text) {
          if (text === null) return;
          var doc = new DOMParser().parseFromString(text, "text/html");
          var fresh = doc.getElementById("live"), here = document.getElementById("live");
          if (fresh && here) here.innerHTML = fresh.innerHTML;
          document.body.dataset.live = doc.body.dataset.live;
          document.body.dataset.refreshed = String(Date.now());
          if (doc.body.dataset.live !== "1") clearInterval(timer);
        })
        .catch(function () { /* the server is gone: keep the last view */ });
    }, 3000);
  }
  document.addEventListener("DOMContentLoaded", function () { onChangeSubmit(); live(); });
})();
