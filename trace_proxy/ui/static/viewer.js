// trace-proxy ui: the only script. Tells the reader when the store has grown since the page
// was made (a proxy still writing it), so new steps and trajectories are one reload away.
"use strict";
(function () {
  const shown = Number(document.body.dataset.generation || 0);
  const notice = document.getElementById("fresh");
  const reload = document.getElementById("reload");
  if (reload) {
    reload.addEventListener("click", function (event) {
      event.preventDefault();
      window.location.reload();
    });
  }
  async function poll() {
    try {
      const response = await fetch("/api/generation", { cache: "no-store" });
      const body = await response.json();
      if (Number(body.generation) > shown && notice) {
        notice.hidden = false;
        return;
      }
    } catch (error) {
      // the viewer stopped: try again later
    }
    window.setTimeout(poll, 2000);
  }
  window.setTimeout(poll, 2000);
})();
