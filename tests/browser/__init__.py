"""Browser tests of the built-in chat page (server/static) in headless Chromium."""
