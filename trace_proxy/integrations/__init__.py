"""Code that runs inside other programs (verl's agent loop). The core never imports this
package, and what is here imports the framework it plugs into lazily."""
