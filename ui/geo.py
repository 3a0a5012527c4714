import streamlit as st

st.title("geo")
st.info("This page is being built.")
