// Draws the book's mermaid diagrams (```mermaid blocks in the notebooks' markdown) as SVG, with the site's
// own copy of mermaid, fetched once from the npm registry at build time: nothing is loaded from elsewhere.
// mermaid (3.5 MB) is loaded only on pages that have a diagram. `window.minillmDiagrams` is a promise that
// settles when every diagram of the page is drawn (the browser tests wait on it).
(function () {
  const here = document.currentScript.src;
  window.minillmDiagrams = new Promise((resolve, reject) => {
    document.addEventListener("DOMContentLoaded", () => {
      const blocks = document.querySelectorAll("div.highlight-mermaid");
      if (!blocks.length) return resolve(0);
      for (const block of blocks) {
        const diagram = document.createElement("pre");
        diagram.className = "mermaid";
        diagram.textContent = block.querySelector("pre").textContent;
        block.replaceWith(diagram);
      }
      const script = document.createElement("script");
      script.src = new URL("mermaid/mermaid.min.js", here).href;
      script.onerror = () => reject(new Error("the site's copy of mermaid did not load"));
      script.onload = () => {
        mermaid.initialize({ startOnLoad: false, securityLevel: "strict" });
        mermaid.run({ querySelector: "pre.mermaid" }).then(() => resolve(blocks.length), reject);
      };
      document.head.appendChild(script);
    });
  });
})();
