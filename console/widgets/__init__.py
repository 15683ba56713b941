"""The console's widgets and screens. They render what they are given and hold no engine state."""
