"""Where training values come from: verl's file logger (followed) and the in-process Monitor API."""
