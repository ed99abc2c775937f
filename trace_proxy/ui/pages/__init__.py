"""The viewer's pages, one module per family; each has `attach(app, site)`, which adds its
routes to the app (`server.py` attaches every family listed in `server.PAGES`)."""
