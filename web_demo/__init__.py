"""Static files of the demo page (served at / by `fishgate serve`); a package only so it ships with the wheel."""
